"""The benchmark's bookkeeping (plugins.lab.bench, vasso_bench.fairseq_runs, scripts/benchmark/benchmark.py):
paired ratios, medians, verdicts, state bytes, a tiny interleaved run of 1-3 updates.  No
timed assertions: only the arithmetic on the numbers it measured and the structure of what
it reports."""

import json
import math
import os
import statistics
import sys

import process_group
import pytest
import torch

from bench_samples import JSON_INNER, SIMPLE_INNER
from plugins.lab.bench import models, timing
from vasso_bench import child_env, memory, report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARK = os.path.join(ROOT, "scripts", "benchmark", "benchmark.py")


@pytest.fixture(scope="module")
def fsbench():
    pytest.importorskip("fairseq")
    from vasso_bench import fairseq_runs

    return fairseq_runs


def _block(total, fwdbwd=0.0, base_step=0.0, updates=2, two_pass=0, passes=1.0):
    return {"total": total, "fwdbwd": fwdbwd, "base_step": base_step, "perturb": 0.0, "descend": 0.0,
            "restore": 0.0, "sa_work": total - fwdbwd - base_step, "passes": passes, "two_pass": two_pass,
            "updates": updates}


def test_paired_ratios_and_medians():
    # drift: every method slows down by the same factor in repeat 2; paired ratios cancel it
    blocks = {"adamw": [_block(1.0), _block(3.0), _block(1.1)],
              "sam": [_block(2.0, 1.8, 0.1, two_pass=2, passes=2), _block(6.0, 5.4, 0.3, two_pass=2, passes=2),
                      _block(2.4, 2.0, 0.1, two_pass=2, passes=2)],
              "vasso": [_block(2.1, 1.8, 0.1, two_pass=2, passes=2), _block(6.0, 5.4, 0.3, two_pass=2, passes=2),
                        _block(2.4, 2.1, 0.1, two_pass=2, passes=2)]}
    assert timing.paired_ratios(blocks, "sam", "adamw") == pytest.approx([2.0, 2.0, 2.4 / 1.1])
    s = timing.summarize_timing(blocks)
    assert s["methods"]["sam"]["over_base"] == pytest.approx(2.0)
    assert s["methods"]["sam"]["ratio_kind"] == "median of paired repeats"
    assert s["vasso_over_sam"] == pytest.approx(1.0)  # median of 1.05, 1.0, 1.0
    assert s["vasso_over_sam_iqr"][0] <= 1.0 <= s["vasso_over_sam_iqr"][1]
    # from the parts: SAM's median update 2.4 s, VASSO's SA work (median 0.2 s) - SAM's (median 0.3 s)
    assert s["vasso_over_sam_from_parts"] == pytest.approx((2.4 - 0.1) / 2.4)
    assert s["methods"]["sam"]["total"] == pytest.approx(2400.0)  # ms, median of the blocks
    assert s["methods"]["sam"]["sa_share"] == pytest.approx(0.05)  # (2 - 1.8 - 0.1) / 2, (6-5.4-0.3)/6, ...
    assert s["methods"]["sam"]["two_pass_fraction"] == 1.0 and s["methods"]["adamw"]["two_pass_fraction"] is None
    assert "over_base" not in s["methods"]["adamw"]
    assert timing.median([3.0, float("nan"), 1.0]) == 2.0 and math.isnan(timing.median([]))


def test_efficient_variant_uses_summed_blocks():
    # the coin gave 2, 0, 1 two-pass updates in blocks of 2: per-block ratios 2, 1, 1.5
    blocks = {"adamw": [_block(1.0)] * 3,
              "evasso": [_block(2.0, two_pass=2), _block(1.0, two_pass=0), _block(1.5, two_pass=1)]}
    row = timing.summarize_timing(blocks)["methods"]["evasso"]
    assert row["two_pass_fraction"] == pytest.approx(0.5)
    assert row["over_base"] == pytest.approx(4.5 / 3.0) and row["ratio_kind"] == "sum over repeats"


def test_verdicts():
    def method(over, share=0.01, p=1.0):
        return {"over_base": over, "sa_share": share, "two_pass_fraction": p}

    results = {"timing": {"transformer": {"methods": {"sam": method(2.05), "vasso": method(2.11, 0.06),
                                                      "evasso": method(1.62, p=0.52)},
                                          "vasso_over_sam": 1.02},
                          "many-small": {"methods": {}, "vasso_over_sam": 1.2}},
               "state": {"transformer": {"vasso": {"param_bytes": 400, "extra_state_bytes": 400}},
                         "many-small": {"vasso": {"param_bytes": 400, "extra_state_bytes": 404}}}}
    T = report.TARGETS_TEXT
    results["fairseq"] = {"vasso_time_over_sam": 1.01, "sam_time_over_adam": 2.05, "vasso_time_over_adam": 2.2}
    rows = {(r[0], r[1]): (r[2], r[3]) for r in report.target_rows(results)}
    fs = "fairseq-train (CPU time per update)"
    assert rows[(T["vasso_over_sam"], fs)] == ("1.010", "PASS")
    assert rows[(T["sam_over_base"].replace("SAM / AdamW", "SAM / adam"), fs)] == ("2.050", "PASS")
    assert rows[(T["sam_over_base"].replace("SAM / AdamW", "VASSO / adam"), fs)] == ("2.200", "MISS")
    assert rows[(T["vasso_over_sam"], "transformer")] == ("1.020", "PASS")
    assert rows[(T["vasso_over_sam"], "many-small")] == ("1.200", "MISS")
    assert rows[(T["sam_over_base"], "transformer")] == ("2.050", "PASS")
    ev = [v for k, v in rows.items() if k[0] == T["evasso_over_base"]]
    assert ev == [("1.620", "PASS")]  # limit 1 + 0.52 + 0.1 = 1.62
    assert rows[(T["sa_share"], "transformer, SAM")] == ("1.00%", "PASS")
    assert rows[(T["sa_share"], "transformer, VASSO")] == ("6.00%", "MISS")
    assert rows[(T["vasso_state"], "transformer")][1] == "PASS"
    assert rows[(T["vasso_state"], "many-small")][1] == "MISS"


def test_state_bytes_of_each_method():
    cfg = models.TINY_MODELS["many-small"]
    st = memory.state_table({"m": cfg}, ["adamw", "sam", "vasso", "evasso", "evasso-nostab"], steps=3)["m"]
    pb = st["adamw"]["param_bytes"]
    assert all(s["param_bytes"] == pb for s in st.values())
    assert st["adamw"]["extra_state_bytes"] == 0
    # AdamW: exp_avg and exp_avg_sq per parameter plus a 0-dim step per tensor
    n_tensors = len(list(models.build(cfg)[0].parameters()))
    assert st["adamw"]["base_state_bytes"] == 2 * pb + 4 * n_tensors
    assert st["sam"]["extra_state_bytes"] == pb and st["vasso"]["extra_state_bytes"] == pb
    assert st["evasso-nostab"]["extra_state_bytes"] == pb
    assert st["evasso"]["extra_state_bytes"] in (pb, 2 * pb)  # + previous_ascent once a two-pass step ran


def test_tiny_interleaved_run():
    cfg = models.TINY_MODELS["transformer"]
    blocks = timing.interleaved_timing(cfg, ["adamw", "sam", "vasso", "evasso"], reps=2, block=2, warmup=1,
                                      clock="wall")
    assert {m: len(b) for m, b in blocks.items()} == {"adamw": 2, "sam": 2, "vasso": 2, "evasso": 2}
    for m, bl in blocks.items():
        for b in bl:
            assert b["updates"] == 2 and b["total"] > 0
    assert all(b["passes"] == 1.0 and b["two_pass"] == 0 for b in blocks["adamw"])
    assert all(b["passes"] == 2.0 and b["two_pass"] == 2 for b in blocks["sam"] + blocks["vasso"])
    for b in blocks["evasso"]:
        assert b["passes"] == 1.0 + b["two_pass"] / 2
    s = timing.summarize_timing(blocks)
    assert set(s["methods"]) == {"adamw", "sam", "vasso", "evasso"} and math.isfinite(s["vasso_over_sam"])
    assert s["methods"]["sam"]["passes_per_update"] == 2.0


def test_same_start_for_every_method():
    a = timing.Runner("adamw", models.TINY_MODELS["many-small"])
    v = timing.Runner("vasso", models.TINY_MODELS["many-small"])
    for p, q in zip(a.model.parameters(), v.model.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(a.loss_fn(), v.loss_fn())


def test_memory_child_in_process():
    res = memory.memory_child("many-small", "vasso", 2, tiny=True)
    assert res["extra_state_bytes"] == res["param_bytes"] and res["peak_growth"] >= 0


def test_memory_child_as_its_own_process():
    """What run_memory starts for each method: python -m vasso_bench.memory, one JSON line."""
    proc = process_group.run([sys.executable, "-m", "vasso_bench.memory", "many-small", "sam", "--steps", "2",
                              "--tiny"], capture_output=True, text=True, timeout=300,
                             env=child_env(dict(os.environ, OMP_NUM_THREADS="1")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["method"] == "sam" and res["extra_state_bytes"] == res["param_bytes"]


def test_fairseq_ups_skips_the_first_line(fsbench):
    text = "\n".join(SIMPLE_INNER[:2] + [JSON_INNER, "noise"])
    assert fsbench.fairseq_ups(text) == [15.35, 8.05]
    cmd = fsbench.fairseq_command("DATA", "vasso", 10, "SAVE", 2)
    assert cmd[cmd.index("--optimizer") + 1] == "vasso" and "--theta" in cmd and "--rho" in cmd
    assert "--rho" not in fsbench.fairseq_command("DATA", "adam", 10, "SAVE", 2)
    # the flags are those of the recipe's rows (fairseq_vasso.nmt.recipe.METHODS), not a copy
    from fairseq_vasso.nmt import recipe as nmt

    assert cmd[cmd.index("--optimizer"):cmd.index("--optimizer") + 6] == nmt.method_flags("vasso0.4")


def _benchmark(*args):
    proc = process_group.run([sys.executable, BENCHMARK, *args], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_cli_tiny_report(tmp_path):
    md = tmp_path / "b.md"
    _benchmark("--tiny", "--quick", "--no-fairseq", "--no-memory", "--reps", "1", "--markdown", str(md),
               "--json", str(tmp_path / "b.json"))
    text = md.read_text()
    assert "### Targets" in text and "| transformer | VASSO |" in text and "torch " + torch.__version__ in text
    assert "fairseq-train: skipped (--no-fairseq)" in text
    assert "PASS" in text or "MISS" in text
    again = tmp_path / "again.md"
    _benchmark("--render", str(tmp_path / "b.json"), "--markdown", str(again))
    assert again.read_text().split("### Targets")[1] == text.split("### Targets")[1]


def test_fairseq_from_parts(fsbench):
    # update i: (CPU s of the update, passes, CPU s of its forward/backward); the vasso process ran
    # 20 % slower overall (a loaded machine), which the parts-based ratio must not see
    adam = [[(1.0 + 0.1, 1, 1.0), (2.0 + 0.1, 1, 2.0)]]
    vasso = [[(1.2 * (2 * 1.0) + 0.12, 2, 1.2 * 2.0), (1.2 * (2 * 2.0) + 0.12, 2, 1.2 * 4.0)]]
    out = fsbench.fairseq_from_parts({"adam": adam, "vasso": vasso}, skip=0)
    # per pass: median of adam's 1.0 and vasso's 1.2 = 1.1 (update 0), 2.2 (update 1)
    assert out["vasso_over_adam_from_parts"] == pytest.approx(
        statistics.median([(2 * 1.1 + 0.12) / (1.1 + 0.1), (2 * 2.2 + 0.12) / (2.2 + 0.1)]))
    assert out["rest_ms"]["adam"] == pytest.approx(100.0) and out["rest_ms"]["vasso"] == pytest.approx(120.0)
    assert fsbench.fairseq_from_parts({"vasso": vasso}, skip=0) == {}


def test_floor_verdicts():
    results = {"floor": {"sam_over_floor": 1.19, "vasso_over_floor": 1.26, "model": "many-small-120",
                         "sam_over_floor_iqr": [1.1, 1.2], "vasso_over_floor_iqr": [1.2, 1.3]}}
    T = report.TARGETS_TEXT
    rows = {(r[0], r[1]): (r[2], r[3]) for r in report.target_rows(results)}
    assert rows[(T["sam_over_floor"], "many-small-120")] == ("1.190 (IQR 1.10-1.20)", "PASS")
    assert rows[(T["vasso_over_floor"], "many-small-120")] == ("1.260 (IQR 1.20-1.30)", "MISS")


def test_tiny_floor_run():
    cfg = models.TINY_FLOOR_MODEL
    model, _ = models.build(cfg)
    assert len(list(model.parameters())) == 4 * cfg["blocks"]  # Linear + LayerNorm per block, no head
    assert len(list(models.build(models.FLOOR_MODEL)[0].parameters())) == 120
    out = timing.floor_ratios(cfg, reps=3, block=1, warmup=1, clock="wall")
    for m in ("sam", "vasso"):
        assert len(out[f"{m}_over_floor_all"]) == 3 and out[f"{m}_over_floor"] > 0
    assert set(out["ms"]) == {"adamw-2pass", "sam", "vasso"}
    runner = timing.Runner("adamw-2pass", cfg, clock="wall")
    assert runner.block(2)["passes"] == 2.0  # the floor runs both passes, as SAM and VASSO do


@pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"), reason="no CPU GradScaler before torch 2.3")
def test_tiny_scaler_run_scales_for_real():
    cfg = models.TINY_FLOOR_MODEL
    out = timing.scaler_ratios(cfg, reps=3, block=1, warmup=1, clock="wall")
    for m in ("sam", "vasso"):
        assert len(out[f"{m}_scaled_over_unscaled_all"]) == 3 and out[f"{m}_scaled_over_unscaled"] > 0
    assert set(out["ms"]) == {"sam", "sam-scaled", "vasso", "vasso-scaled"}
    scaled, plain = timing.Runner("vasso-scaled", cfg, clock="wall"), timing.Runner("vasso", cfg, clock="wall")
    for runner in (scaled, plain):
        runner.block(3)
    assert scaled.scaler.get_scale() == 2.0 ** 16  # a real scaler, no overflow in 3 updates of an fp32 model
    # the scaled runner took the same steps as the unscaled one (power-of-two scaling is exact)
    for a, b in zip(scaled.model.parameters(), plain.model.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    text = "\n".join(report._scaler_section({"scaler": dict(out, model_info="many-small-120 (tiny)")}))
    assert "### Loss scaling: a scaled step over an unscaled one" in text and "VASSO scaled / unscaled = " in text


@pytest.mark.parametrize("module, argv, flag", [
    ("vasso_bench.cli", ["--tiny", "--quick", "--json", "EXISTING"], "--json"),
    ("vasso_bench.cli", ["--tiny", "--markdown", "EXISTING"], "--markdown"),
    ("experiments", ["tradeoff", "--json", "EXISTING"], "--json"),
])
def test_a_finished_result_is_not_overwritten_without_force(module, argv, flag, tmp_path, capsys):
    # refused before any work, naming the file and --force (plugins.lab.tables.refuse_existing)
    import importlib
    existing = tmp_path / "result.json"
    existing.write_text('{"measured": "an hour ago"}')
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main([str(existing) if a == "EXISTING" else a for a in argv])
    assert exc.value.code == 2
    assert f"{flag} {existing} exists: give a new file, or --force to overwrite it" in capsys.readouterr().err
    assert existing.read_text() == '{"measured": "an hour ago"}'
