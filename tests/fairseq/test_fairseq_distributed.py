"""Item 3: distributed on CPU (gloo, legacy_ddp, 2 ranks, one process each).

The ranks stay identical, eps comes from the all-reduced gradient (the logged
rho*||d_t|| is the same on both ranks and equals the one of a single rank that sees
both halves of the batch), and 2 ranks match 1 rank with --update-freq 2 on the same
data.  The training set is the 40-sentence split in batches of 20: rank r gets
batch r of each epoch, the single rank gets both in one update."""

import cpu_only
import process_group
import pytest

try:
    import fairseq  # noqa: F401
except ImportError as exc:  # not installed, or broken against this torch
    pytest.skip(f"fairseq is not importable ({exc}); pip install --no-build-isolation fairseq-fixed==0.12.3.1",
                allow_module_level=True)

import math
import os
import subprocess
import sys
import textwrap

import torch
from ports import free_port

DRIVER = textwrap.dedent('''
    import os, sys
    import torch
    if os.environ.get("FSV_CPU_HALF"):  # --amp on a CPU: the device checks the in-process tests patch
        from tests.fairseq.conftest import cpu_half_precision_patches

        for owner, name, value in cpu_half_precision_patches():
            setattr(owner, name, value)
    import fairseq_vasso  # noqa: F401  (the hooks, as --user-dir would install them)
    from fairseq.trainer import Trainer

    stock = Trainer.train_step
    log = []

    def train_step(self, samples, raise_oom=False):
        out = stock(self, samples, raise_oom)
        inner = getattr(self.optimizer, "fp32_optimizer", self.optimizer)
        diag = dict(getattr(inner, "last_diagnostics", {}))
        scaler = getattr(self.optimizer, "scaler", None)
        scale = scaler.get_scale() if hasattr(scaler, "get_scale") else getattr(scaler, "loss_scale", None)
        log.append({"num_updates": self.get_num_updates(), "loss_scale": scale, **diag})
        model = {k: v.detach().clone() for k, v in self.get_model().state_dict().items()}
        torch.save({"model": model, "log": log}, os.environ["FSV_DUMP"])
        return out

    Trainer.train_step = train_step
    from fairseq_cli.train import cli_main
    sys.argv = ["fairseq-train"] + sys.argv[1:]
    cli_main()
''')


def _common(fs, data, save_dir):
    return fs.model_args(data, save_dir, optimizer="vasso", max_update=4, extra=[
        "--rho", "0.5", "--theta", "0.4", "--train-subset", "valid", "--disable-validation",
        "--dropout", "0", "--max-tokens", "4000", "--batch-size", "20", "--required-batch-size-multiple", "1"])


def _two_ranks_and_one(fs, data, tmp_path, extra=(), env=()):
    """2 ranks (subprocesses) and, meanwhile, 1 rank with --update-freq 2 in this process;
    returns the ranks' outputs and dumps, the single run and its last checkpoint's model."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    port = free_port()
    procs = []
    for rank in range(2):
        argv = _common(fs, data, tmp_path / f"rank{rank}") + [
            "--ddp-backend", "legacy_ddp", "--distributed-backend", "gloo", "--distributed-world-size", "2",
            "--distributed-rank", str(rank), "--distributed-init-method", f"tcp://127.0.0.1:{port}",
            "--distributed-no-spawn", "--no-save", *extra]
        env_r = {"PYTHONPATH": os.pathsep.join([str(fs.REPO), str(fs.REPO / "tests" / "helpers"),  # conftest's imports
                                                os.environ.get("PYTHONPATH", "")]),
                 "FSV_DUMP": str(tmp_path / f"rank{rank}.pt"), "OMP_NUM_THREADS": "1", **dict(env)}
        procs.append(process_group.popen([sys.executable, str(driver), *argv], cwd=str(tmp_path),
                                         env=cpu_only.env({**os.environ, **env_r}),  # --cpu ranks
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        # meanwhile, the single-rank reference in this process, on one thread as the ranks run
        # (a sum's rounding depends on how many threads split it; pytest may run without
        # OMP_NUM_THREADS=1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            single_run = fs.train(_common(fs, data, tmp_path / "single") + ["--update-freq", "2", *extra])
        finally:
            torch.set_num_threads(threads)
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outs.append(out)
    finally:
        for p in procs:  # a failure or timeout above must not leave a rank waiting for its peer
            process_group.kill_group(p)
            p.wait()
    # fairseq-train sometimes aborts at exit after finishing (rc 134): judge by the log
    assert "done training" in outs[0], outs[0][-3000:]
    assert "distributed init (rank 1)" in outs[1] or "rank 1" in outs[1], outs[1][-3000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=True)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=True)
    single = fs.load_checkpoint(tmp_path / "single" / "checkpoint_last.pt")["model"]
    return outs, r0, r1, single_run, single


def test_two_ranks_match_one_rank_with_update_freq_2(toy_data, tmp_path, fs):
    outs, r0, r1, single_run, single = _two_ranks_and_one(fs, toy_data, tmp_path)
    assert [e["num_updates"] for e in r0["log"]] == [1, 2, 3, 4] == [e["num_updates"] for e in r1["log"]]
    # the ranks stay identical, bit for bit
    for k in r0["model"]:
        assert torch.equal(r0["model"][k], r1["model"][k]), k
    # one eps for both ranks: the same ascent statistics, from the all-reduced gradient
    for a, b in zip(r0["log"], r1["log"]):
        assert a["two_pass"] == b["two_pass"] == 1.0
        for key in ("sharpness", "stability", "ascent_norm"):
            assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    # ... the same as the single rank's, which sees the whole batch (a rank-local
    # gradient, half the batch, would give another rho * ||d_t||)
    for a, line in zip(r0["log"], single_run.inner()):
        assert abs(a["sharpness"] - float(line["sharpness"])) <= 1e-4, (a, line)
    # 2 ranks x 20 sentences == 1 rank x 2 micro-batches of 20
    worst = max(float((r0["model"][k] - single[k]).abs().max()) for k in single)
    # (bit for bit here: a + b is the same sum either way; allow rounding elsewhere)
    assert worst <= 1e-5, worst


def test_amp_two_ranks_with_real_overflows_match_one_rank(toy_data, tmp_path, fs, cpu_half_precision):
    """--amp on 2 ranks (the CPU scaler and fp16 autocast in every process) from a loss
    scale that overflows for real: both ranks see the same overflows (the all-reduced
    gradient), skip and retry the same batches, back the scale off together and stay
    identical; the result matches 1 rank with --update-freq 2 under the same overflows."""
    extra = ["--amp", "--fp16-init-scale", str(2 ** 20)]
    outs, r0, r1, single_run, single = _two_ranks_and_one(fs, toy_data, tmp_path, extra, {"FSV_CPU_HALF": "1"})
    # rank 0 logs fairseq's overflow lines (the other ranks log warnings only)
    assert outs[0].count("AMP: overflow detected") == len(fs.overflow_scales(single_run)) >= 10
    updates = [e["num_updates"] for e in r0["log"]]  # every train_step call, retries included
    assert updates == [e["num_updates"] for e in r1["log"]] and updates[-1] == 4
    scales = [e["loss_scale"] for e in r0["log"]]  # the same skips and back-offs on both ranks
    assert scales == [e["loss_scale"] for e in r1["log"]] and scales[-1] <= 2 ** 10
    for k in r0["model"]:
        assert torch.equal(r0["model"][k], r1["model"][k]), k
    taken = [e for i, e in enumerate(r0["log"]) if e["num_updates"] > max(updates[:i], default=0)]
    assert len(taken) == 4 and all(e["ascent_norm"] == pytest.approx(0.5, rel=1e-4) for e in taken)
    for a, line in zip(taken, single_run.inner()):
        assert abs(a["sharpness"] - float(line["sharpness"])) <= 1e-3 * abs(a["sharpness"]), (a, line)
    worst = max(float((r0["model"][k] - single[k]).abs().max()) for k in single)
    assert worst <= 1e-4, worst
