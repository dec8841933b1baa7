"""``RotatedDigits``: DomainBed's RotatedMNIST recipe applied to scikit-learn's bundled
UCI digits (1,797 8x8 images, 10 classes, no download), small enough for a CPU sweep.

    python -m domainbed_vasso.sweep launch --datasets RotatedDigits --algorithms ERM SAM VASSO \\
        --data_dir unused --output_dir sweep_digits/ --command_launcher local \\
        --hparams '{"mlp_width": 128, "mlp_depth": 3, "mlp_dropout": 0.0, "lr": 0.001, "batch_size": 64}'

(``scripts/digits/digits_sweep.sh`` runs exactly this and prints the table.)

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
  which DomainBed's registry defines for DANN/CDANN only; :func:`registry_hparams`
  (applied by ``register()``) gives every algorithm on RotatedDigits those three, with
  the defaults and search ranges DomainBed gives DANN, and the registry entries of
  RotatedMNIST (DomainBed's small-image ``lr`` 1e-3, ``batch_size`` 64, no weight
  decay) instead of the big-image ones any unknown dataset would get. The sweep above
  overrides some of them with ``--hparams``, as any DomainBed sweep may;
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


NAME = "RotatedDigits"

#: The stock dataset whose registry entries RotatedDigits takes: both are rotated small
#: images, and DomainBed's registry only tells small images (its SMALL_IMAGES) from big.
HPARAMS_LIKE = "RotatedMNIST"

#: The MLP featurizer's hparams: (name, default, random draw), DomainBed's values for DANN.
MLP_HPARAMS = (
    ("mlp_width", 256, lambda r: int(2 ** r.uniform(6, 10))),
    ("mlp_depth", 3, lambda r: int(r.choice([3, 4, 5]))),
    ("mlp_dropout", 0.0, lambda r: float(r.choice([0.0, 0.1, 0.5]))),
)


def registry_hparams(stock_hparams, algorithm, random_seed, seed_hash):
    """DomainBed's ``_hparams(algorithm, "RotatedDigits", random_seed)``: the entries of
    ``stock_hparams(algorithm, HPARAMS_LIKE, random_seed)`` plus, where the algorithm
    defines none, the MLP featurizer's, each drawn from
    ``RandomState(seed_hash(random_seed, name))`` as DomainBed draws its own."""
    out = stock_hparams(algorithm, HPARAMS_LIKE, random_seed)
    for name, default, random_fn in MLP_HPARAMS:
        if name not in out:
            out[name] = (default, random_fn(np.random.RandomState(seed_hash(random_seed, name))))
    return out


def register(datasets_module):
    """Make ``RotatedDigits`` a DomainBed dataset (``get_dataset_class`` and
    ``num_environments`` look names up in the module's globals); idempotent.

    It does not join ``datasets.DATASETS``: that list is DomainBed's default for a
    sweep without ``--datasets`` and the loop of DomainBed's own tests, and both should
    stay what DomainBed users know. ``python -m domainbed_vasso.collect_results`` adds
    it to the list in its own process, since collect_results prints only listed names.
    """
    existing = vars(datasets_module).get(NAME)
    if existing is None or not getattr(existing, "_domainbed_vasso", False):
        cls = make_dataset_class(datasets_module.MultipleDomainDataset)
        cls._domainbed_vasso = True
        setattr(datasets_module, NAME, cls)
    return getattr(datasets_module, NAME)


def list_in_datasets(datasets_module):
    """Append ``RotatedDigits`` to ``datasets.DATASETS`` in this process (for tables); idempotent."""
    if NAME not in datasets_module.DATASETS:
        datasets_module.DATASETS.append(NAME)
