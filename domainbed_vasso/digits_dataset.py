"""``RotatedDigits``: DomainBed's RotatedMNIST recipe applied to scikit-learn's bundled
UCI digits (1,797 8x8 images, 10 classes, no download), small enough for a CPU sweep.

    python -m domainbed_vasso.sweep launch --datasets RotatedDigits --algorithms ERM SAM VASSO \\
        --data_dir unused --output_dir sweep_digits/ --command_launcher local \\
        --hparams '{"mlp_width": 128, "mlp_depth": 3, "mlp_dropout": 0.0, "lr": 0.001, "batch_size": 64}'

(``scripts/domainbed/digits_sweep.sh`` runs exactly this and prints the table.)

As RotatedMNIST does with MNIST: the images are shuffled once and dealt round-robin
into the environments, and every image of environment ``i`` is rotated by
``ENVIRONMENTS[i]`` degrees (bilinear, zero fill), so each domain holds different
digits. Differences from RotatedMNIST, all for the sake of a CPU:

* four domains, 0, 30, 60 and 90 degrees (about 450 digits each), not RotatedMNIST's
  six at 15-degree steps: leave-one-domain-out selection needs a run for every pair
  of test domains too, so a sweep has 10 test-domain sets per algorithm and trial
  instead of 21 (the paper's four DomainBed datasets also have four domains each);
* the shuffle uses its own generator (seed 0), not DomainBed's global seed, so every
  run of a sweep sees the same domains (DomainBed's in/out split inside each
  domain still follows the trial seed);
* the 8x8 images are flattened: ``input_shape = (64,)``, so DomainBed picks its MLP
  featurizer. That featurizer reads ``mlp_width``, ``mlp_depth`` and ``mlp_dropout``,
  which DomainBed's registry defines for DANN/CDANN only: pass them with ``--hparams``
  (as above). DomainBed's registry also gives datasets outside its SMALL_IMAGES list
  the big-image ``lr`` (5e-5) and ``batch_size`` (32): set them too;
* ``N_WORKERS = 0`` (the tensors are in memory), ``N_STEPS = 301`` (about 50 epochs
  of each training domain at batch 64), ``CHECKPOINT_FREQ = 50``. Run the children
  with ``OMP_NUM_THREADS=1``: with torch's default threads on a busy 2-core machine
  a job burns ten times the CPU.

``data_dir`` is not read (the data ship with scikit-learn), but DomainBed's scripts
require the flag.
"""

import numpy as np
import torch
from torch.utils.data import TensorDataset

ANGLES = (0, 30, 60, 90)
SHUFFLE_SEED = 0


def rotated_digit_domains(angles=ANGLES, seed=SHUFFLE_SEED):
    """``[(images float32 [n_i, 64] in [0, 1], labels int64 [n_i])]``, one pair per angle,
    a pure function of ``(angles, seed)``."""
    from sklearn.datasets import load_digits
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import rotate

    d = load_digits()
    images = torch.from_numpy((d.images / 16.0).astype(np.float32))[:, None]  # [N, 1, 8, 8]
    labels = torch.from_numpy(d.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    out = []
    for i, angle in enumerate(angles):
        x = images[i::len(angles)]
        if angle:
            x = rotate(x, float(angle), interpolation=InterpolationMode.BILINEAR, fill=[0.0])
        out.append((x.reshape(len(x), -1).contiguous(), labels[i::len(angles)].clone()))
    return out


def make_dataset_class(base):
    """The DomainBed dataset class, built on DomainBed's ``MultipleDomainDataset``."""

    class RotatedDigits(base):
        ENVIRONMENTS = [str(a) for a in ANGLES]
        INPUT_SHAPE = (64,)
        N_STEPS = 301
        CHECKPOINT_FREQ = 50
        N_WORKERS = 0

        def __init__(self, root, test_envs, hparams):
            super().__init__()
            self.datasets = [TensorDataset(x, y) for x, y in rotated_digit_domains()]
            self.input_shape = self.INPUT_SHAPE
            self.num_classes = 10

    RotatedDigits.__module__ = __name__
    return RotatedDigits


def register(datasets_module):
    """Add ``RotatedDigits`` to DomainBed's ``datasets`` module (``get_dataset_class``
    looks names up in its globals; ``DATASETS`` orders collect_results); idempotent."""
    existing = vars(datasets_module).get("RotatedDigits")
    if existing is None or not getattr(existing, "_domainbed_vasso", False):
        cls = make_dataset_class(datasets_module.MultipleDomainDataset)
        cls._domainbed_vasso = True
        datasets_module.RotatedDigits = cls
    if "RotatedDigits" not in datasets_module.DATASETS:
        datasets_module.DATASETS.append("RotatedDigits")
    return datasets_module.RotatedDigits
