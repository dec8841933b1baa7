"""RotatedDigits, the DomainBed dataset of domainbed_vasso/digits_dataset.py.

The pure data tests run everywhere; those that need DomainBed skip, saying how to
provide it, when it is not importable."""

import json
import os
import subprocess
import sys

import process_group
import pytest
import torch

from domainbed_vasso import _locate
from domainbed_vasso import digits_dataset as DD

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _domainbed_importable():
    try:
        _locate.import_domainbed()
        return True
    except ImportError:
        return False


needs_domainbed = pytest.mark.skipif(
    not _domainbed_importable(),
    reason=_locate.NOT_IMPORTABLE)


def test_domains_partition_the_digits_deterministically():
    doms = DD.rotated_digit_domains()
    again = DD.rotated_digit_domains()
    assert len(doms) == len(DD.ANGLES) == 4
    assert sum(len(y) for _, y in doms) == 1797
    assert [len(y) for _, y in doms] == [450, 449, 449, 449]
    for (x, y), (x2, y2) in zip(doms, again):
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert x.shape == (len(y), 64) and x.dtype == torch.float32
        assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 + 1e-6
        assert set(y.tolist()) == set(range(10))


def test_angle_zero_is_the_original_images_and_others_are_rotated():
    from sklearn.datasets import load_digits

    d = load_digits()
    x0, y0 = DD.rotated_digit_domains(angles=(0,))[0]
    originals = {tuple((img / 16.0).astype("float32").reshape(-1).tolist()) for img in d.images}
    assert all(tuple(row.tolist()) in originals for row in x0[:50])
    # the same digits at 90 degrees are the 0-degree images turned by a quarter
    r0 = DD.rotated_digit_domains(angles=(0, 0))[0][0].view(-1, 8, 8)
    r90 = DD.rotated_digit_domains(angles=(90, 0))[0][0].view(-1, 8, 8)
    torch.testing.assert_close(r90, torch.rot90(r0, 1, dims=(1, 2)), atol=1e-5, rtol=0)


@needs_domainbed
def test_registered_in_domainbed():
    import domainbed_vasso

    domainbed_vasso.register()
    from domainbed import datasets

    cls = datasets.get_dataset_class("RotatedDigits")
    assert "RotatedDigits" not in datasets.DATASETS  # default sweeps stay DomainBed's
    assert datasets.num_environments("RotatedDigits") == 4
    ds = cls(None, [0], {})
    assert ds.input_shape == (64,) and ds.num_classes == 10 and len(ds) == 4
    x, y = ds[1][0]
    assert x.shape == (64,)
    domainbed_vasso.register()  # idempotent
    assert datasets.get_dataset_class("RotatedDigits") is cls


@needs_domainbed
def test_a_few_training_steps_through_domainbed(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    hp = {"mlp_width": 16, "mlp_depth": 3, "mlp_dropout": 0.0, "lr": 1e-3, "batch_size": 8}
    out = tmp_path / "run"
    process_group.run([sys.executable, "-m", "domainbed_vasso.train", "--data_dir", str(tmp_path),
                       "--dataset", "RotatedDigits", "--algorithm", "VASSO", "--test_envs", "0", "1",
                       "--steps", "3", "--checkpoint_freq", "2", "--output_dir", str(out),
                       "--hparams", json.dumps(hp)], check=True, cwd=tmp_path, env=env,
                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert records and records[-1]["args"]["dataset"] == "RotatedDigits"
    assert {"env0_out_acc", "env3_in_acc"} <= set(records[-1])
    assert (out / "done").exists()
    tables = process_group.run([sys.executable, "-m", "domainbed_vasso.tables", str(tmp_path),
                                "--datasets", "RotatedDigits", "--selection", "oracle"],
                               check=True, cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    assert "RotatedDigits" in tables and "VASSO" in tables
