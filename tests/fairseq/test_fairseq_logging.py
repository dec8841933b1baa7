"""Item 8: every log line (simple, json, TensorBoard) carries the ascent norm, the
perturbed-loss gap f(x+eps) - f(x), the estimated sharpness rho*||v_t|| and
||eps_t - eps_{t-1}||, averaged over the log interval."""

import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import math
import struct


KEYS = ("ascent_norm", "loss_gap", "sharpness", "stability", "two_pass", "rho")


def _parse_simple(line):
    # "epoch 001:      4 / 13 loss=7.6, nll_loss=7.5, ..., ascent_norm=0.1, ..."
    body = line.split(" / ", 1)[1].split(" ", 1)[1]
    return dict(item.split("=", 1) for item in body.split(", "))


def _read_events(folder):
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_every_log_line_carries_the_diagnostics_averaged(toy_data, tmp_path, fs):
    pytest.importorskip("tensorboardX", reason="TensorBoard logging needs tensorboardX")
    from fairseq.logging import progress_bar

    extra = ["--rho", "0.2", "--theta", "0.4", "--disable-validation", "--no-save"]
    per_update = fs.train(fs.model_args(toy_data, tmp_path / "json", max_update=8, extra=extra)).inner()
    assert len(per_update) == 8
    for line in per_update:  # json, every update
        assert all(k in line for k in KEYS), line
    # the first update has no eps_{t-1}; afterwards the stability measure is defined
    assert math.isnan(float(per_update[0]["stability"]))
    assert all(float(s["stability"]) > 0 for s in per_update[1:])
    assert all(float(s["loss_gap"]) > 0 for s in per_update)  # the ascent increases the loss

    tb = tmp_path / "tb"
    progress_bar._tensorboard_writers.clear()
    try:
        run = fs.train(fs.model_args(toy_data, tmp_path / "simple", max_update=8, extra=extra + [
            "--log-format", "simple", "--log-interval", "4", "--tensorboard-logdir", str(tb)]))
        for w in progress_bar._tensorboard_writers.values():
            w.flush()
    finally:
        progress_bar._close_writers()
        progress_bar._tensorboard_writers.clear()
    lines = [_parse_simple(m) for name, m in run.records if name == "train_inner" and " / " in m]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert all(k in line for k in KEYS), line
        chunk = per_update[4 * i:4 * i + 4]
        for key in ("ascent_norm", "loss_gap", "sharpness"):
            mean = sum(float(s[key]) for s in chunk) / 4
            assert float(line[key]) == pytest.approx(mean, abs=2e-3), key
        finite = [float(s["stability"]) for s in chunk if not math.isnan(float(s["stability"]))]
        assert float(line["stability"]) == pytest.approx(sum(finite) / len(finite), abs=2e-3)

    events = _read_events(tb / "train_inner")
    for key in KEYS[:4]:
        steps = [step for step, _ in events[key]]
        assert steps == [4, 8], (key, events.get(key))
        for (step, value), line in zip(events[key], lines):
            assert value == pytest.approx(float(line[key]), abs=1e-3)


# ------------------------------------------------------------------ warnings that are not ours

def test_fairseq_train_prints_only_its_own_and_our_warnings(toy_data, tmp_path, fs):
    # stock fairseq-train prints ~15 lines of Hydra/torch deprecations that fairseq causes;
    # with the user-dir imported, none of them (torch.jit.script's comes before any user-dir)
    out = fs.run_cli("fairseq_cli.train", fs.model_args(toy_data, tmp_path, max_update=2) + ["--no-save"])
    assert out.returncode == 0, out.stderr[-3000:]
    for needle in ("hydra.experimental", "version_base", "ConfigStore schema", "strict flag",
                   "package header", "torch.cuda.amp.autocast", "key_padding_mask", "pin_memory"):
        assert needle not in out.stderr, out.stderr[-3000:]
    assert "done training" in out.stdout + out.stderr


def test_only_the_listed_foreign_warnings_are_silenced():
    import warnings

    from fairseq_vasso import _foreign_warnings as foreign

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        foreign.silence_foreign_warnings()
        warnings.warn("hydra.experimental.compose() is no longer experimental. Use hydra.compose()")
        warnings.warn("\n'config' is validated against ConfigStore schema with the same name.")
        warnings.warn("`torch.cuda.amp.autocast(args...)` is deprecated. Please use ...", FutureWarning)
        # ours, and foreign ones not on the list, still show
        warnings.warn("VASSO: non-finite gradient, step skipped", RuntimeWarning)
        warnings.warn("theta is not used by SAM")
        warnings.warn("hydra.experimental.compose() is no longer experimental", DeprecationWarning)
    assert [str(w.message) for w in seen] == [
        "VASSO: non-finite gradient, step skipped", "theta is not used by SAM",
        "hydra.experimental.compose() is no longer experimental"]


def test_setup_cfg_silences_the_same_foreign_warnings_in_the_tests(fs):
    import configparser

    from fairseq_vasso._foreign_warnings import FOREIGN

    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(fs.REPO / "setup.cfg")
    lines = [line.strip() for line in cfg["tool:pytest"]["filterwarnings"].splitlines() if line.strip()]
    for category, message in FOREIGN:
        assert f"ignore:{message}:{category.__name__}" in lines
