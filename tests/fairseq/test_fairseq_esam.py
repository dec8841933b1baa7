"""Item 7: eSAM / eVASSO (--perturb-prob p < 1): the logged fraction of two-pass
updates is close to p (and exactly 0 or 1 at the ends)."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import math


def _run(fs, data, path, opt, p, n, extra=()):
    return fs.train(fs.model_args(data, path, optimizer=opt, max_update=n, extra=[
        "--rho", "0.1", "--perturb-prob", str(p), "--log-interval", "10", "--max-tokens", "150",
        "--disable-validation", "--no-save", *extra]))


def test_two_pass_fraction_is_close_to_p(toy_data, tmp_path, fs):
    n, p = 60, 0.3
    run = _run(fs, toy_data, tmp_path / "esam", "sam", p, n)
    lines = run.inner()
    assert len(lines) == n // 10 and all("two_pass" in s for s in lines)
    per_interval = [float(s["two_pass"]) for s in lines]
    frac = sum(per_interval) / len(per_interval)
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n), frac  # 4 sigma of a Binomial(n, p) / n
    epoch = [float(s["train_two_pass"]) for s in run.stats("train")]
    assert all(0.0 < f < 1.0 for f in epoch)
    # intervals with a two-pass update report its ascent; the others report nan (no eps_t)
    for s, f in zip(lines, per_interval):
        if f > 0:
            assert float(s["ascent_norm"]) == 0.1
        else:
            assert math.isnan(float(s["ascent_norm"]))

    # eVASSO with the same seed draws the same coins (a function of (--seed, step))
    ev = _run(fs, toy_data, tmp_path / "evasso", "vasso", p, n)
    assert [s["two_pass"] for s in ev.inner()] == [s["two_pass"] for s in lines]
    # another --seed, other coins
    other = _run(fs, toy_data, tmp_path / "seed", "sam", p, 30, ["--seed", "11"])
    assert [s["two_pass"] for s in other.inner()] != [s["two_pass"] for s in lines[:3]]


def test_two_pass_fraction_ends(toy_data, tmp_path, fs):
    never = _run(fs, toy_data, tmp_path / "p0", "vasso", 0.0, 10)
    always = _run(fs, toy_data, tmp_path / "p1", "vasso", 1.0, 10)
    assert [float(s["two_pass"]) for s in never.inner()] == [0.0]
    assert [float(s["two_pass"]) for s in always.inner()] == [1.0]
