"""The device benchmark (vasso_bench.device, scripts/benchmark/benchmark.py --device), its anchors
(vasso_bench.anchors), the phase profiler (vasso_bench.profile) and the host-cost
proxies (vasso_bench.host).  Nothing here times anything: the verdicts are checked on
made-up per-round ratios, the runs on the CPU's small sizes for a round or two, and the
profiler's GPU columns on a made-up trace."""

import os
import sys
import textwrap

import pytest
import torch

from vasso_bench import anchors, device, host, phases, profile
from plugins.lab.bench.timing import quartiles

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARK = os.path.join(ROOT, "scripts", "benchmark", "benchmark.py")

# A checkout laid out as BingcongLi/VaSSO is (solver/ imports itself and the top-level
# namespace package utils/), and one as davda54/sam is (sam.py): small first_step /
# second_step optimizers over a base optimizer, as theirs are.
VASSO_FILES = {
    "solver/__init__.py": "from .build import OPTIMIZER_REGISTRY\nfrom .vasso import VASSO\n",
    "solver/build.py": "from utils.register import Registry\nOPTIMIZER_REGISTRY = Registry()\n",
    "utils/register.py": "class Registry:\n    def register(self):\n        return lambda cls: cls\n",
    "solver/vasso.py": textwrap.dedent("""\
        import torch
        from solver.build import OPTIMIZER_REGISTRY

        @OPTIMIZER_REGISTRY.register()
        class VASSO(torch.optim.Optimizer):
            def __init__(self, params, base_optimizer, rho, theta):
                self.base_optimizer = base_optimizer
                super().__init__(params, dict(rho=rho, theta=theta))
                self.param_groups = self.base_optimizer.param_groups
                for g in self.param_groups:
                    g["rho"], g["theta"] = rho, theta

            @torch.no_grad()
            def first_step(self, zero_grad=False):
                ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                for p in ps:
                    st = self.state[p]
                    theta = self.param_groups[0]["theta"]
                    st["ema"] = p.grad.clone() if "ema" not in st else st["ema"].lerp_(p.grad, theta)
                norm = torch.stack([self.state[p]["ema"].norm() for p in ps]).norm()
                for p in ps:
                    self.state[p]["e_w"] = self.state[p]["ema"] * (self.param_groups[0]["rho"] / (norm + 1e-7))
                    p.add_(self.state[p]["e_w"])
                if zero_grad:
                    self.zero_grad()

            @torch.no_grad()
            def second_step(self, zero_grad=False):
                for g in self.param_groups:
                    for p in g["params"]:
                        if p.grad is not None:
                            p.sub_(self.state[p]["e_w"])
                self.base_optimizer.step()
                if zero_grad:
                    self.zero_grad()
        """),
}
SAM_FILE = textwrap.dedent("""\
    import torch

    class SAM(torch.optim.Optimizer):
        def __init__(self, params, base_optimizer, rho=0.05, adaptive=False, **kwargs):
            super().__init__(params, dict(rho=rho, adaptive=adaptive, **kwargs))
            self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
            self.param_groups = self.base_optimizer.param_groups

        @torch.no_grad()
        def first_step(self, zero_grad=False):
            ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.stack([p.grad.norm() for p in ps]).norm()
            for p in ps:
                self.state[p]["old_p"] = p.data.clone()
                p.add_(p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12)))
            if zero_grad:
                self.zero_grad()

        @torch.no_grad()
        def second_step(self, zero_grad=False):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        p.data = self.state[p]["old_p"]
            self.base_optimizer.step()
            if zero_grad:
                self.zero_grad()
    """)


def _write(root, files):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


@pytest.fixture
def checkouts(tmp_path):
    return {"--reference-vasso": _write(tmp_path / "VaSSO", VASSO_FILES),
            "--reference-sam": _write(tmp_path / "sam", {"sam.py": SAM_FILE})}


# ------------------------------------------------------------------ verdicts

def test_verdict_needs_the_whole_interval_of_the_median_on_one_side():
    below = [1.00 + 0.001 * (i % 20) for i in range(30)]  # 1.000-1.019: wholly within 1.03
    assert device.verdict(below, 1.03) == "PASS"
    above = [x + 0.05 for x in below]  # 1.050-1.069
    assert device.verdict(above, 1.03) == "MISS"
    straddling = [1.00 + 0.002 * i for i in range(30)]  # 1.000-1.058: the 10th and 21st, 1.018 and 1.040
    assert device.interval(straddling) == pytest.approx((1.018, 1.040))
    assert device.verdict(straddling, 1.03) == "too noisy"
    assert device.verdict(below[:29], 1.03) == "no verdict: 29 rounds < 30"
    assert device.verdict(below + [float("nan")] * 3, 1.03) == "PASS"  # non-finite rounds do not count


def test_a_verdict_reads_the_median_and_its_interval_not_the_spread_of_the_rounds():
    # the rounds of a noisy host: a quarter far below, a quarter far above, the middle at 1.02; the IQR
    # straddles 1.03 however many rounds there are, the interval of the median narrows to 1.02
    noisy = [0.90] * 8 + [1.02] * 14 + [1.20] * 8
    q1, q3 = quartiles(noisy)
    assert q1 < 1.03 < q3
    assert device.interval(noisy) == (1.02, 1.02) and device.verdict(noisy, 1.03) == "PASS"
    # the same median with fewer rounds near it: too noisy in 30 rounds, decided in 120 like them
    thin = [0.90] * 12 + [1.02] * 6 + [1.20] * 12
    assert device.interval(thin) == (0.90, 1.20) and device.verdict(thin, 1.03) == "too noisy"
    assert device.interval(thin * 4) == (1.02, 1.02) and device.verdict(thin * 4, 1.03) == "PASS"


def test_faster_than_an_anchor_is_strict():
    assert device.verdict([1.0] * 30, 1.0) == "PASS"  # "<= 1": ties meet a cost limit
    assert device.verdict([1.0] * 30, 1.0, strict=True) == "MISS"  # "< 1": a tie is not faster
    assert device.verdict([0.97 + 0.001 * i for i in range(30)], 1.0, strict=True) == "PASS"


def _rounds(ms_by_method, passes=2.0):
    return {m: {"ms": list(ms), "host_ms": [1.0] * len(ms), "passes": [passes] * len(ms)}
            for m, ms in ms_by_method.items()}


def test_ratios_are_paired_within_a_round_and_goal_rows():
    # the machine drifts 2x between rounds: paired ratios cancel it, unpaired medians would not
    n = 30
    drift = [1.0 if i % 2 else 2.0 for i in range(n)]
    rounds = _rounds({"adamw-2pass": [100 * d for d in drift], "SAM": [101 * d for d in drift],
                      "VASSO": [110 * d for d in drift], "ref-vasso": [120 * d for d in drift],
                      "ref-sam": [101 * d for d in drift]})
    s = device.summarize(rounds)
    assert s["pairs"]["SAM/adamw-2pass"]["median"] == pytest.approx(1.01)
    assert s["pairs"]["SAM/adamw-2pass"]["iqr"] == pytest.approx([1.01, 1.01])
    assert s["pairs"]["VASSO/ref-vasso"]["median"] == pytest.approx(110 / 120)
    assert "ref-vasso/adamw-2pass" in s["pairs"] and "SAM/ref-sam" in s["pairs"]
    assert s["methods"]["VASSO"]["ms_iqr"][0] < s["methods"]["VASSO"]["ms_iqr"][1]  # the drift shows unpaired
    mib = 2 ** 20
    results = {"models": {"transformer": {"summary": s, "memory": {"VASSO": {"peak_bytes": 3000 * mib},
                                                                    "ref-vasso": {"peak_bytes": 4000 * mib}}}}}
    rows = {r[1]: (r[2], r[3]) for r in device.goal_rows(results)}
    assert rows["SAM / AdamW, two passes <= 1.02"][1] == "PASS"
    assert rows["VASSO / AdamW, two passes <= 1.03"] == ("1.100 (95 % CI 1.100-1.100; IQR 1.100-1.100, 30 rounds)",
                                                         "MISS")
    assert rows["VASSO faster than the official VASSO (ratio < 1)"][1] == "PASS"
    assert rows["SAM faster than davda54's SAM (ratio < 1)"][1] == "MISS"  # a tie is not faster
    assert rows["VASSO's peak memory below the official VASSO's"] == ("3000 MiB vs 4000 MiB", "PASS")


def test_rounds_rotate_the_order():
    calls = []

    class Fake:
        passes = 0

        def __init__(self, name):
            self.name = name

        def step(self):
            calls.append(self.name)
            self.passes += 2

    rows = {m: Fake(m) for m in ("a", "b", "c")}
    out = device.interleaved_rounds(rows, rounds=4, steps=2, clock=device.HostClock())
    assert calls == ["a"] * 2 + ["b"] * 2 + ["c"] * 2 + ["b"] * 2 + ["c"] * 2 + ["a"] * 2 + \
        ["c"] * 2 + ["a"] * 2 + ["b"] * 2 + ["a"] * 2 + ["b"] * 2 + ["c"] * 2
    assert all(len(v["ms"]) == 4 and v["passes"] == [2.0] * 4 for v in out.values())


def test_rounds_tell_the_host_cpu_time_from_the_host_wall_time():
    """A step that waits (a sleep: the host not running the thread, as on a busy or
    preempted host) shows in the host wall time and not in the host CPU time; a step that
    computes shows in both."""
    import time

    class Waits:
        passes = 0

        def step(self):
            time.sleep(0.02)

    class Computes:
        passes = 0

        def step(self):
            t = time.thread_time()
            while time.thread_time() - t < 0.02:
                pass

    out = device.interleaved_rounds({"waits": Waits(), "computes": Computes()}, rounds=3, steps=1,
                                    clock=device.HostClock())
    assert min(out["waits"]["host_ms"]) >= 19.0 and max(out["waits"]["host_cpu_ms"]) < 5.0
    assert min(out["computes"]["host_cpu_ms"]) >= 19.0 and min(out["computes"]["host_ms"]) >= 19.0
    s = device.summarize(out)["methods"]
    assert s["waits"]["host_cpu_ms"] < 5.0 <= s["waits"]["host_ms"]


class _Ticks:
    """A made-up clock that each step moves by one second (perf_counter and thread_time alike)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    thread_time = perf_counter

    def row(self, interrupt_at=None):
        ticks = self

        class Row:
            passes = 0

            def step(self):
                ticks.now += 1.0
                if interrupt_at is not None and ticks.now >= interrupt_at:
                    raise KeyboardInterrupt
        return Row()


def test_seconds_add_rounds_while_one_more_ends_in_time(monkeypatch):
    """``seconds`` adds rounds while another as long as the last still ends within it: the
    count is the clock's; ``rounds`` stays the least."""
    ticks = _Ticks()
    monkeypatch.setattr(device, "time", ticks)
    rows = {m: ticks.row() for m in "abc"}  # a round takes 3 s
    clock = device.HostClock()
    out = device.interleaved_rounds(rows, rounds=1, steps=1, clock=clock, seconds=10)
    assert device.finished(out) == 3  # rounds end at 3, 6 and 9 s: a fourth would end at 12
    assert out["a"]["ms"] == [1000.0] * 3
    ticks.now = 0.0
    assert device.finished(device.interleaved_rounds(rows, rounds=5, steps=1, clock=clock, seconds=10)) == 5
    ticks.now = 0.0
    assert device.finished(device.interleaved_rounds(rows, rounds=2, steps=1, clock=clock, seconds=None)) == 2
    ticks.now = 0.0
    assert device.finished(device.interleaved_rounds(rows, rounds=1, steps=2, clock=clock, seconds=12)) == 2


def test_an_interrupted_run_keeps_the_rounds_it_finished(monkeypatch):
    ticks = _Ticks()
    monkeypatch.setattr(device, "time", ticks)
    rows = {"a": ticks.row(), "b": ticks.row(interrupt_at=7)}  # the 4th round (b first) stops in its first step
    with pytest.raises(device.Interrupted) as stop:
        device.interleaved_rounds(rows, rounds=30, steps=1, clock=device.HostClock())
    assert device.finished(stop.value.rounds) == 3
    assert all(len(v) == 3 for r in stop.value.rounds.values() for v in r.values())


def test_an_interrupted_device_run_reports_what_finished(monkeypatch):
    """Stopped inside a model's rounds, the run returns the models done and that model's
    finished rounds, and says where it stopped; stopped outside them, nothing of that model."""
    calls = {"n": 0}

    def rounds_then_stop(rows, rounds, steps, clock, log=None, seconds=None):
        calls["n"] += 1
        out = {m: {"ms": [10.0] * 30, "host_ms": [1.0] * 30, "host_cpu_ms": [1.0] * 30, "passes": [2.0] * 30}
               for m in rows}
        if calls["n"] == 2:
            raise device.Interrupted(out)
        return out

    monkeypatch.setattr(device, "interleaved_rounds", rounds_then_stop)
    rows = ["adamw-2pass", "VASSO"]
    res = device.run("cpu", models=["transformer", "resnet50"], rows=rows, rounds=30, warmup=0, memory=False)
    assert list(res["models"]) == ["transformer", "resnet50"]
    assert res["interrupted"] == "during resnet50's timed rounds, after 30 finished round(s), kept below"
    assert device.finished(res["models"]["resnet50"]["rounds"]) == 30
    text = device.render(res)
    assert "**Interrupted** during resnet50's timed rounds" in text
    assert "| resnet50 | VASSO / AdamW, two passes <= 1.03 |" in text

    def build_stops(cfg, seed=0):
        raise KeyboardInterrupt

    monkeypatch.setattr(device, "build_template", build_stops)
    res = device.run("cpu", models=["transformer"], rows=rows, rounds=30, warmup=0, memory=False)
    assert res["models"] == {} and res["interrupted"] == "during transformer, outside its timed rounds: " \
        "nothing of transformer kept"


# ------------------------------------------------------------------ models and rows

def test_the_issues_models_at_full_size():
    for md, tensors, mib in (("resnet50", 161, 97.5), ("transformer", 188, 179.0)):
        cfg = device.SIZES["full"][md]
        model = device.build_template(cfg)
        ps = list(model.parameters())
        assert len(ps) == tensors
        assert sum(q.numel() * 4 for q in ps) / 2 ** 20 == pytest.approx(mib, abs=0.1)
    assert set(device.ROWS) >= {"adamw-1pass", "adamw-2pass", "SAM", "VASSO", "eSAM", "eVASSO", "ASAM", "GSAM",
                                "V+G", "ref-vasso", "ref-sam"}


def test_every_row_steps_on_the_cpu(checkouts):
    classes = {flag: anchors.load(flag, path) for flag, path in checkouts.items()}
    cfg = device.SIZES["small"]["transformer"]
    template = device.build_template(cfg)
    batch = device.make_batch(cfg, torch.device("cpu"))
    start = [q.detach().clone() for q in template.parameters()]
    for name in device.ROWS:
        row = device.Row(name, template, cfg, batch, torch.device("cpu"), classes)
        for _ in range(2):
            row.step()
        expected = 1 if name == "adamw-1pass" else 2
        if name in ("eSAM", "eVASSO"):
            assert row.passes in (2, 3, 4)  # the coin: one or two passes per step
        else:
            assert row.passes == 2 * expected, name
        assert any(not torch.equal(a, b.detach()) for a, b in zip(start, row.model.parameters())), name
    assert all(torch.equal(a, b) for a, b in zip(start, template.parameters()))  # each row trains a copy


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_adamw_implementation_reaches_every_base(impl, checkouts):
    classes = {flag: anchors.load(flag, path) for flag, path in checkouts.items()}
    cfg = device.SIZES["small"]["transformer"]
    template = device.build_template(cfg)
    batch = device.make_batch(cfg, torch.device("cpu"))
    for name in ("adamw-2pass", "VASSO", "ref-vasso", "ref-sam"):
        row = device.Row(name, template, cfg, batch, torch.device("cpu"), classes, adamw=impl)
        base = getattr(row.opt, "base_optimizer", row.opt)
        assert isinstance(base, torch.optim.AdamW) and base.defaults[impl] is True, name
        row.step()


def test_a_small_run_reports_every_part(checkouts):
    classes = {flag: anchors.load(flag, path) for flag, path in checkouts.items()}
    rows = ["adamw-1pass", "adamw-2pass", "SAM", "VASSO", "ref-vasso", "ref-sam"]
    res = device.run("cpu", models=["transformer"], rows=rows, rounds=2, warmup=1, mem_steps=1,
                     anchor_classes=classes, command="python scripts/benchmark/benchmark.py --device cpu")
    t = res["models"]["transformer"]
    assert set(t["rounds"]) == set(rows) and all(len(v["ms"]) == 2 for v in t["rounds"].values())
    assert set(t["memory"]) == set(rows)
    text = device.render(res)
    assert "### Verdicts (the step-cost goal)" in text
    assert "| transformer | VASSO / AdamW, two passes <= 1.03 |" in text
    ratio_rows = [line for line in text.splitlines() if line.startswith("| transformer |") and "rounds)" in line]
    assert len(ratio_rows) == 4 and all(line.endswith("| no verdict: 2 rounds < 30 |") for line in ratio_rows)
    assert "| official VASSO (BingcongLi/VaSSO) |" in text and "| davda54 SAM |" in text
    assert "| AdamW, one pass |" in text and "peak memory (alone)" in text
    assert "non-finite" not in text  # no step was skipped: none is reported
    t["nonfinite_steps"] = {"VASSO": 3}
    assert "- **VASSO (theta=0.4) skipped 3 step(s) for a non-finite gradient**" in device.render(res)
    without = device.run("cpu", models=["transformer"], rows=rows, rounds=1, warmup=0, memory=False)
    assert without["left_out"] == ["ref-vasso", "ref-sam"]
    assert "Left out (no checkout given): official VASSO" in device.render(without)


# ------------------------------------------------------------------ anchors

def test_anchors_load_from_a_dir_and_lend_it_their_package_names(checkouts, monkeypatch):
    sentinel = type(sys)("utils")  # this process's own top-level 'utils' must survive
    monkeypatch.setitem(sys.modules, "utils", sentinel)
    vasso = anchors.load("--reference-vasso", checkouts["--reference-vasso"])
    sam = anchors.load("--reference-sam", checkouts["--reference-sam"])
    assert vasso.__name__ == "VASSO" and sam.__name__ == "SAM"
    assert sys.modules["utils"] is sentinel and "solver" not in sys.modules
    assert checkouts["--reference-vasso"] not in sys.path
    assert not any(os.path.abspath(p) == os.path.abspath(checkouts["--reference-vasso"]) for p in sys.path)


@pytest.mark.parametrize("flag", ["--reference-vasso", "--reference-sam"])
def test_anchor_errors_name_the_flag(flag, tmp_path):
    with pytest.raises(anchors.AnchorError, match=f"^{flag} {tmp_path / 'nope'}: no such folder"):
        anchors.load(flag, str(tmp_path / "nope"))
    with pytest.raises(anchors.AnchorError, match=f"^{flag} {tmp_path}: has no"):
        anchors.load(flag, str(tmp_path))
    broken = {"--reference-vasso": {"solver/vasso.py": "raise ImportError('no timm')\n"},
              "--reference-sam": {"sam.py": "class NotSAM: pass\n"}}[flag]
    _write(tmp_path, broken)
    with pytest.raises(anchors.AnchorError, match=f"^{flag} {tmp_path}: "):
        anchors.load(flag, str(tmp_path))


def test_an_anchors_commit_is_its_own_checkouts(tmp_path):
    """A checkout's commit names the anchor; a copy without git metadata inside another
    repository (as one carried to an offline GPU node) is "not a git checkout", not that
    repository's commit."""
    import subprocess

    own = tmp_path / "own"
    subprocess.run(["git", "init", "-q", str(own)], check=True)
    subprocess.run(["git", "-C", str(own), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q",
                    "--allow-empty", "-m", "anchor"], check=True)
    head = subprocess.run(["git", "-C", str(own), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert anchors.provenance(str(own)).endswith(f"(git {head})")
    copy = own / "copies" / "VaSSO"
    copy.mkdir(parents=True)
    assert anchors.provenance(str(copy)).endswith("(not a git checkout)")


@pytest.mark.skipif(not (os.environ.get("VASSO_REFERENCE_VASSO") and os.environ.get("VASSO_REFERENCE_SAM")),
                    reason="set VASSO_REFERENCE_VASSO and VASSO_REFERENCE_SAM to checkouts of BingcongLi/VaSSO and "
                           "davda54/sam to run the anchors' own code")
def test_the_real_anchors_step():
    classes = {"--reference-vasso": anchors.load("--reference-vasso", os.environ["VASSO_REFERENCE_VASSO"]),
               "--reference-sam": anchors.load("--reference-sam", os.environ["VASSO_REFERENCE_SAM"])}
    cfg = device.SIZES["small"]["transformer"]
    template = device.build_template(cfg)
    batch = device.make_batch(cfg, torch.device("cpu"))
    for name in ("ref-vasso", "ref-sam"):
        row = device.Row(name, template, cfg, batch, torch.device("cpu"), classes)
        row.step()
        assert row.passes == 2
        assert any(not torch.equal(a, b) for a, b in zip(template.parameters(), row.model.parameters()))


# ------------------------------------------------------------------ the command line

@pytest.fixture(scope="module")
def benchmark_main():
    from vasso_bench.cli import main
    return main


def _refused(main, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_cuda_without_a_gpu_is_refused(benchmark_main, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, also where there is one
    err = _refused(benchmark_main, ["--device", "cuda"], capsys)
    assert "error: --device cuda: torch sees no CUDA device" in err


def test_bad_input_is_refused_before_any_work(benchmark_main, capsys, tmp_path, monkeypatch, checkouts):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the checks after the device's
    monkeypatch.setattr(device, "run", lambda *a, **k: pytest.fail("work started"))
    assert "error: --rounds 29: at least 30 on --device cuda" in _refused(
        benchmark_main, ["--device", "cuda", "--rounds", "29"], capsys)
    assert "error: --rounds 0: at least 1" in _refused(benchmark_main, ["--device", "cpu", "--rounds", "0"], capsys)
    missing = str(tmp_path / "no-such-dir")
    assert f"error: --reference-vasso {missing}: no such folder (give a checkout of BingcongLi/VaSSO)" in _refused(
        benchmark_main, ["--device", "cuda", "--reference-vasso", missing], capsys)
    assert f"error: --reference-sam {tmp_path}: has no sam.py (give a checkout of davda54/sam)" in _refused(
        benchmark_main, ["--device", "cuda", "--reference-sam", str(tmp_path)], capsys)
    assert "error: --reference-vasso is an option of the device benchmark" in _refused(
        benchmark_main, ["--reference-vasso", checkouts["--reference-vasso"]], capsys)
    assert "error: --rows ref-sam: needs --reference-sam DIR" in _refused(
        benchmark_main, ["--device", "cpu", "--rows", "VASSO", "ref-sam"], capsys)
    assert "error: --models: many-small is not a model of --device" in _refused(
        benchmark_main, ["--device", "cpu", "--models", "many-small"], capsys)
    for bad in ("0", "-5", "nan", "inf"):
        assert f"error: --seconds {float(bad)}: a number of seconds above 0" in _refused(
            benchmark_main, ["--device", "cpu", "--seconds", bad], capsys)
    assert "error: --seconds is an option of the device benchmark" in _refused(
        benchmark_main, ["--seconds", "60"], capsys)
    assert "error: --seconds is for the device benchmark, not for --profile" in _refused(
        benchmark_main, ["--profile", "--seconds", "60"], capsys)


def test_cli_on_the_cpu_with_anchors(benchmark_main, checkouts, tmp_path, capsys):
    md = tmp_path / "device.md"
    assert benchmark_main(["--device", "cpu", "--models", "transformer", "--rows", "adamw-2pass", "VASSO",
                           "ref-vasso", "--rounds", "1", "--warmup", "0", "--reference-vasso",
                           checkouts["--reference-vasso"], "--markdown", str(md), "--json",
                           str(tmp_path / "device.json")]) == 0
    text = md.read_text()
    assert "## Device benchmark: cpu, small sizes" in text
    assert f"Anchor --reference-vasso: {checkouts['--reference-vasso']} (not a git checkout)." in text
    assert "| transformer | VASSO faster than the official VASSO (ratio < 1) |" in text
    assert "Command: `python scripts/benchmark/benchmark.py --device cpu --models transformer" in text
    again = tmp_path / "again.md"
    assert benchmark_main(["--render", str(tmp_path / "device.json"), "--markdown", str(again)]) == 0
    assert again.read_text().split("### Verdicts")[1] == text.split("### Verdicts")[1]


def test_sigterm_writes_the_rounds_finished_and_exits_130(tmp_path):
    """A scheduler's or ``timeout``'s SIGTERM in the middle of a run: the report and the raw
    results of the rounds finished are written, and the exit status says it was interrupted."""
    import json
    import signal
    import subprocess
    import time

    import process_group

    md, js = tmp_path / "run.md", tmp_path / "run.json"
    proc = process_group.popen([sys.executable, BENCHMARK, "--device", "cpu", "--models", "transformer", "--rows",
                                "adamw-2pass", "VASSO", "--warmup", "0", "--seconds", "600", "--markdown", str(md),
                                "--json", str(js)], stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        seen = []
        deadline = time.monotonic() + 300
        for line in proc.stderr:  # the log: every 10th round
            seen.append(line)
            if line.startswith("  round 10 ") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("  round 10 "), "".join(seen)[-2000:]
        proc.send_signal(signal.SIGTERM)  # to the benchmark's own pid
        rest = proc.communicate(timeout=120)[1]
    finally:
        process_group.kill_group(proc)
    assert proc.returncode == 130, rest[-2000:]
    assert "benchmark.py: interrupted during transformer's timed rounds, after" in rest
    res = json.loads(js.read_text())
    assert device.finished(res["models"]["transformer"]["rounds"]) >= 10
    assert "**Interrupted** during transformer's timed rounds" in md.read_text()


def test_fail_on_miss_exits_1_on_a_miss_only(benchmark_main, monkeypatch, capsys):
    n = 30
    rounds = _rounds({"adamw-2pass": [100.0] * n, "SAM": [101.0] * n, "VASSO": [110.0] * n})
    results = {"models": {"transformer": {"summary": device.summarize(rounds), "memory": {}}}}
    monkeypatch.setattr(device, "run", lambda *a, **k: results)
    monkeypatch.setattr(device, "render", lambda res: "the report")
    argv = ["--device", "cpu", "--models", "transformer", "--rounds", "30"]
    assert benchmark_main(argv) == 0
    assert benchmark_main(argv + ["--fail-on-miss"]) == 1
    assert "benchmark.py: MISS: transformer: VASSO / AdamW, two passes <= 1.03" in capsys.readouterr().err
    rounds["VASSO"]["ms"] = [102.0] * n
    results["models"]["transformer"]["summary"] = device.summarize(rounds)
    assert benchmark_main(argv + ["--fail-on-miss"]) == 0


# ------------------------------------------------------------------ profile and host cost

def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_profile_reads_a_gpu_trace_by_phase():
    """A made-up trace of one step as torch.profiler exports it on a GPU: the step's ranges,
    ops, runtime calls with their kernels (linked by correlation), a sync in perturb and
    gaps on the GPU."""
    R = phases.RANGES
    ev = [_x("user_annotation", R["step"], 0, 1000), _x("user_annotation", R["pass"], 10, 300),
          _x("user_annotation", R["pass"], 500, 300), _x("user_annotation", R["base"], 850, 100),
          _x("cpu_op", "aten::mm", 20, 50), _x("cpu_op", "aten::addmm", 30, 10),  # nested in aten::mm
          _x("cuda_runtime", "cudaLaunchKernel", 40, 5, correlation=1),
          _x("kernel", "gemm", 100, 200, correlation=1),
          # perturb: two launches, a sync
          _x("cpu_op", "aten::_foreach_norm", 320, 20), _x("cpu_op", "aten::_local_scalar_dense", 360, 50),
          _x("cuda_runtime", "cudaLaunchKernel", 325, 5, correlation=2),
          _x("cuda_runtime", "cudaMemcpyAsync", 362, 5, correlation=3),
          _x("cuda_runtime", "cudaStreamSynchronize", 370, 30),
          _x("kernel", "norm", 330, 10, correlation=2), _x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 400, 2,
                                                           correlation=3),
          # second pass, launched after the sync: the GPU waited 98 us for it
          _x("cuda_runtime", "cudaLaunchKernel", 510, 5, correlation=4), _x("kernel", "gemm", 500, 250, correlation=4),
          # the base step
          _x("cuda_runtime", "cudaLaunchKernel", 860, 5, correlation=5), _x("kernel", "adam", 860, 20, correlation=5)]
    # the kernel of pass 2 ran at 500 per this made-up clock; make it later than the copy
    res = profile.analyze({"traceEvents": ev})
    p = res["phases"]
    assert p["first pass"]["top_ops"] == 1 and p["first pass"]["ops"] == 2 and p["first pass"]["kernels"] == 1
    assert p["perturb"]["launches"] == 1 and p["perturb"]["syncs"] == 1 and p["perturb"]["dtoh"] == 1
    assert p["perturb"]["item_calls"] == 1 and p["perturb"]["kernels"] == 1
    assert p["second pass"]["launches"] == 1 and p["base step"]["kernels"] == 1
    # gaps: 300 -> 330 (30 us, charged to perturb), 340 -> 400 (60, perturb), 402 -> 500 (98, second pass),
    # 750 -> 860 (110, base step)
    assert p["perturb"]["idle_us"] == pytest.approx(90.0) and p["perturb"]["gaps"] == 2
    assert p["second pass"]["idle_us"] == pytest.approx(98.0)
    assert p["base step"]["idle_us"] == pytest.approx(110.0)
    assert res["gaps_top"][0]["phase"] == "base step"
    # the optimizer's own Python in perturb: 500 - 310 us of host time less 20 + 50 us inside its top-level ops
    assert p["perturb"]["python_us"] == pytest.approx(190 - 70)


def test_profile_on_the_cpu_says_what_it_cannot_measure():
    res = profile.run("cpu", model="transformer", warmup=1, steps=2, profiled=2)
    p = res["phases"]
    assert set(p) == set(phases.PHASES)
    assert p["first pass"]["top_ops"] > 0 and p["second pass"]["top_ops"] > 0 and p["perturb"]["top_ops"] > 0
    assert p["perturb"]["launches"] == 0 and not res["has_gpu"]
    # the tests' counter: VASSO reads the host at most twice per step in its own phases
    own_syncs = sum(p[k]["syncs_counted"] for k in phases.OWN)
    assert 0 <= own_syncs <= 2
    text = profile.render(res)
    assert "not measured on a CPU: kernel launches" in text and "| perturb |" in text


def test_profile_command_refuses_bad_input(capsys, tmp_path, monkeypatch):
    existing = tmp_path / "trace.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        profile.main(["--trace", str(existing)])
    assert exc.value.code == 2 and (f"--trace {existing} exists: give a new file, or --force to overwrite it"
                                    in capsys.readouterr().err)
    assert existing.read_text() == "{}"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU, also where there is one
    with pytest.raises(SystemExit):
        profile.main(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err


def test_count_ops_leaves_views_out():
    x = torch.ones(4)
    with host.CountOps() as ops:
        y = x.view(2, 2)[0]  # view, select: aliases
        y.add(1).sum()
    assert ops.count == 2 and set(ops.names) == {"aten.add.Tensor", "aten.sum.default"}


def test_count_ops_counts_the_bytes_each_op_reads_and_writes():
    x, y, out = torch.ones(4), torch.ones(4), torch.empty(4)  # 16 bytes each
    with host.CountOps() as ops:
        x.add_(y)                          # reads x and y, writes x
    assert ops.bytes == 48
    with host.CountOps() as ops:
        x.copy_(y)                         # reads y, writes x
        torch._foreach_copy_([x], [y])     # the same, in place, returning nothing
        torch.mul(x, 2.0, out=out)         # reads x, writes out
    assert ops.bytes == 3 * 32


def test_host_cost_counts_the_optimizers_own_work():
    from plugins.lab.bench.models import TINY_FLOOR_MODEL

    ops = host.ops_and_syncs(["SAM", "VASSO", "eVASSO", "ASAM"], model_cfg=TINY_FLOOR_MODEL, warmup=3)  # past set-ups
    for name, row in ops.items():
        assert row["ops"] == sum(row["ops_by_phase"].values()) > 0 and row["base_ops"] > 0
        assert row["passes"] in (1, 2)
        # the optimizer's own reads and writes, in model sizes: SAM's copy of g_t, the ascent and the
        # restore alone read and write more than 6; none reads a model's size 60 times
        assert 6 < row["traffic"] < 60, (name, row)
    # the step-cost goals, on the steps decided on the device (the EMA costs VASSO one kernel, as SAM's
    # copy of g_t): at most 21 ops (SAM) and 26 (VASSO) per step, and one host read with this for-loop
    # base (0 with a fused one: tests/core/test_protocol.py); eVASSO too, its previous ascent kept in a
    # flat buffer (an inner product and a where more, within VASSO's 26); ASAM as well, its T = |x| + eta
    # over one flat buffer (no goal on its ops: its host path took one op or more per tensor, 275 on 120)
    assert ops["SAM"]["ops"] <= 21 and ops["VASSO"]["ops"] <= 26 and ops["eVASSO"]["ops"] <= 26, ops
    # the traffic's ceiling as it stands (19 and 22 model sizes on this model, plus its small
    # tensors' scalars): SAM takes g_t into the scratch, the slope buffer keeps v_{t-1} for the where,
    # so SAM copies one model's size less than VASSO, whose average is in place
    assert ops["SAM"]["traffic"] < 20.5 and ops["VASSO"]["traffic"] < 23.5, ops
    assert ops["ASAM"]["ops"] <= 40, ops
    assert ops["SAM"]["syncs"] == ops["VASSO"]["syncs"] == ops["eVASSO"]["syncs"] == ops["ASAM"]["syncs"] == 1, ops
    t = host.host_time(model_cfg=TINY_FLOOR_MODEL, rounds=2, steps=1, warmup=1)
    assert set(t["ms"]) == {"AdamW", "SAM", "SAM+base", "VASSO", "VASSO+base"}
    assert t["ms"]["VASSO+base"] > t["ms"]["VASSO"] and t["over_adamw"]["VASSO"] > 0
    text = host.render({"date": "d", "cpu": "c", "torch": "t", "threads": 1, "ops": ops, "host": t})
    assert "| VASSO |" in text and "over foreach AdamW" in text and "traffic (model sizes)" in text
