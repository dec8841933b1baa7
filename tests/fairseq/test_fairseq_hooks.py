"""fairseq_vasso.hooks, the one module that patches fairseq: refusals before anything is
built, and a clear one-line failure when a fairseq internal it uses is missing."""

import subprocess
import sys

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)


def test_unsupported_mode_refused_on_the_command_line_before_the_model(toy_data, tmp_path, fs):
    out = fs.run_cli("fairseq_cli.train", fs.model_args(toy_data, tmp_path) + ["--bf16"])
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-2000:]
    assert "Traceback" not in text and "usage:" not in text, text[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "train.py: error: --optimizer vasso does not support --bf16: "), out.stderr  # python -m fairseq_cli.train
    # no task (dictionaries), no model, no data
    assert "dictionary:" not in text and "num. shared model params" not in text and "loaded" not in text


@pytest.mark.parametrize("internal", ["FP16Optimizer._unscale_grads", "Trainer.zero_grad"])
def test_missing_fairseq_internal_fails_in_one_line(internal):
    owner, attr = internal.split(".")
    module = {"FP16Optimizer": "fairseq.optim.fp16_optimizer", "Trainer": "fairseq.trainer"}[owner]
    # deleted where it is defined (FP16Optimizer inherits it from a mixin)
    prelude = (f"import {module} as m; delattr(next(c for c in m.{owner}.__mro__ if {attr!r} in vars(c)), "
               f"{attr!r}); ")
    # as fairseq-train imports the user-dir (fairseq_cli loaded): one line, no traceback
    cli = subprocess.run([sys.executable, "-c", prelude + "import fairseq_cli.train, fairseq_vasso"],
                         capture_output=True, text=True, timeout=120)
    lines = cli.stderr.strip().splitlines()
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr
    assert lines[-1].startswith("error: fairseq_vasso needs fairseq 0.12.2") and internal in lines[-1], lines
    # in a library process: an ImportError subclass with the same message
    lib = subprocess.run([sys.executable, "-c", prelude + "import fairseq_vasso.hooks"],
                         capture_output=True, text=True, timeout=120)
    assert lib.returncode == 1 and "FairseqVersionError: fairseq_vasso needs" in lib.stderr, lib.stderr


# ------------------------------------------------------------------ the command line as fairseq reads it

_BASE = ["/nonexistent-data", "--task", "translation", "--arch", "transformer", "--source-lang", "de",
         "--target-lang", "en"]


def _parse(argv, **kwargs):
    """What fairseq's parse_args_and_arch makes of ``argv``: the parsed values, or the exception."""
    from fairseq import options

    parser = options.get_training_parser()
    try:
        out = options.parse_args_and_arch(parser, argv() if callable(argv) else argv, **kwargs)
    except SystemExit as exc:
        return ("exit", exc.code)
    except Exception as exc:  # the same exception with and without the plugin
        return (type(exc).__name__, str(exc))
    ns = out[0] if isinstance(out, tuple) else out
    return ("parsed", ns.optimizer, getattr(ns, "rho", None), getattr(ns, "save_dir", None), getattr(ns, "max_epoch", None))


@pytest.mark.parametrize("argv", [
    # fairseq's own test helpers pass None for an unset value (tests/test_valid_subset_checks.py)
    _BASE + ["--optimizer", "adam", "--save-dir", None],
    _BASE + ["--optimizer", "vasso", "--save-dir", None],
    _BASE + ["--optimizer", "vasso", "--max-epoch", 1],  # argparse's TypeError, with and without
    _BASE + ["--optimizer=vasso", "--rho=0.2"],
    tuple(_BASE + ["--optimizer", "sam"]),
    lambda: iter(_BASE + ["--optimizer", "vasso"]),  # fairseq reads its input twice: stock fails
    _BASE + ["--optimizer", "vasso", "--optimizer", "adam"],  # the last one wins
    _BASE + ["--optimizer", "adam", "--", "--optimizer", "vasso"],
    _BASE + ["--optimizer"],
], ids=["None-adam", "None-vasso", "int", "equals", "tuple", "iterator", "twice", "after--", "no-value"])
def test_the_plugin_parses_what_stock_fairseq_parses(argv, capsys):
    from fairseq_vasso.hooks import stock_fairseq

    with stock_fairseq():
        stock = _parse(argv)
    assert _parse(argv) == stock
    assert stock[0] != "parsed" or stock[1] in ("adam", "sam", "vasso")


def test_equals_forms_are_checked_and_helped(capsys):
    assert _parse(_BASE + ["--optimizer=vasso", "--rho=-1"]) == ("exit", 2)
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("error: --rho must be in [0, inf), got -1.0")
    assert _parse(_BASE + ["--optimizer=vasso", "--help"]) == ("exit", 0)
    assert "--theta" in capsys.readouterr().out
    # parse_known and suppress_defaults (fairseq's own keywords) reach the same check
    assert _parse(_BASE + ["--optimizer", "sam", "--rho", "-1"], parse_known=True) == ("exit", 2)
    assert _parse(_BASE + ["--optimizer", "sam", "--rho", "0.2"], suppress_defaults=True)[:3] == ("parsed", "sam", 0.2)


def test_the_diagnostics_are_logged_without_a_host_read():
    """A step decided on the device leaves its diagnostics as device values: the hook logs them
    into fairseq's meters as they are (fairseq reads them when it prints, at its log
    interval), with no host sync per update."""
    import types

    import torch
    from fairseq.logging import metrics

    from fairseq_vasso import hooks
    from plugins import VASSO
    from plugins.lab.selftest.syncs import CountSyncs

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    core = VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def closure():
        core.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(3):
        core.step(closure)
    assert core._lists.flat_slope is not None  # the last step was decided on the device
    sa = types.SimpleNamespace(last_diagnostics=core.diagnostics, core=core)
    with metrics.aggregate(new_root=True) as agg:
        with CountSyncs() as syncs:
            hooks._log_diagnostics(sa, types.SimpleNamespace(loss_gap=float("nan")))
        assert syncs.count == 0
        logged = agg.get_smoothed_values()
    assert logged["two_pass"] == 1.0
    assert logged["ascent_norm"] == pytest.approx(0.1, rel=1e-5)
