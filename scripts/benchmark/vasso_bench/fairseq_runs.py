"""The benchmark's fairseq-train comparison (``scripts/benchmark/benchmark.py``): ``--optimizer
vasso`` (and ``sam``) over ``--optimizer adam`` on the toy de-en corpus
(:mod:`fairseq_vasso.nmt.toy_corpus`), one process per run, the CPU time of every
``Trainer.train_step`` timed from outside fairseq_vasso's two-pass step.

    python -m vasso_bench.fairseq_runs STEP_LOG -- FAIRSEQ_TRAIN_ARGS...

runs one such fairseq-train in this process (what :func:`run_fairseq` starts)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any, Callable, Dict, List, Sequence

from plugins.lab.bench.timing import median

from fairseq_vasso.nmt import recipe as nmt, toy_corpus
from vasso_bench import child_env

# the benchmark's --optimizer -> its row of nmt.METHODS (the flags and rho come from there)
OPTIMIZER_ROWS = {"adam": "adamw", "sam": "sam", "vasso": "vasso0.4"}


def prepare_fairseq_data(workdir: str, n_train: int = 2000, log: Callable[[str], None] = lambda s: None) -> str:
    """Generate and binarize the toy de-en corpus once (cached under workdir)."""
    dest = os.path.join(workdir, f"toy-bin-{n_train}")
    if os.path.exists(os.path.join(dest, "train.de-en.de.bin")):
        return dest
    raw = os.path.join(workdir, f"toy-raw-{n_train}")
    os.makedirs(raw, exist_ok=True)
    for split, n, seed in (("train", n_train, 1), ("valid", 100, 2)):
        pairs = toy_corpus.generate(n, seed)
        with open(os.path.join(raw, f"{split}.de"), "w", encoding="utf-8") as fde, \
                open(os.path.join(raw, f"{split}.en"), "w", encoding="utf-8") as fen:
            for de, en in pairs:
                fde.write(de.strip() + "\n")
                fen.write(en.strip() + "\n")
    log(f"  binarizing the toy corpus into {dest}")
    cmd = [nmt.fairseq_bin("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
           "--trainpref", os.path.join(raw, "train"), "--validpref", os.path.join(raw, "valid"),
           "--destdir", dest, "--workers", "1", "--joined-dictionary"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"fairseq-preprocess failed:\n{proc.stderr[-2000:]}")
    return dest


FAIRSEQ_MODEL = ["--arch", "transformer", "--encoder-layers", "2", "--decoder-layers", "2",
                 "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
                 "--encoder-ffn-embed-dim", "512", "--decoder-ffn-embed-dim", "512",
                 "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
                 "--share-all-embeddings", "--dropout", "0.1"]


def fairseq_command(data: str, optimizer: str, max_update: int, save_dir: str, log_interval: int) -> List[str]:
    """One benchmark run: --optimizer adam, sam or vasso with the flags of its nmt.METHODS row."""
    cmd = [nmt.fairseq_bin("fairseq-train"), data, "--user-dir", nmt.default_user_dir(),
           "--task", "translation", "--source-lang", "de", "--target-lang", "en", *FAIRSEQ_MODEL,
           "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
           *nmt.method_flags(OPTIMIZER_ROWS[optimizer]), "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001",
           "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "100",
           "--max-tokens", "2048", "--max-update", str(max_update), "--seed", "1",
           "--cpu", "--num-workers", "0", "--save-dir", save_dir, "--no-save", "--disable-validation",
           "--log-format", "json", "--log-interval", str(log_interval)]
    return cmd


def fairseq_ups(log_text: str) -> List[float]:
    """fairseq's ``ups`` of every ``train_inner`` line but the first (warm-up), json or simple format."""
    from fairseq_vasso.nmt.logs import parse_fairseq_log_text

    records = [r for r in parse_fairseq_log_text(log_text) if r.get("_tag") == "train_inner"]
    return [float(r["ups"]) for r in records[1:] if "ups" in r]


def fairseq_child(step_log: str, argv: Sequence[str]) -> int:
    """Run fairseq-train in this process with every update timed by the hooks' timer
    (:func:`fairseq_vasso.hooks.time_train_steps`: CPU and wall seconds per update, one
    line per update in ``step_log``), from the outside of the two-pass step."""
    from fairseq_cli import train as train_cli

    import fairseq_vasso

    fairseq_vasso.register()
    from fairseq_vasso import hooks

    with open(step_log, "w", encoding="utf-8") as out:
        def write(cpu, wall, passes, passes_cpu):
            # columns: CPU s of the update, wall s, forward/backward passes, their CPU s
            out.write(f"{cpu:.6f} {wall:.6f} {passes} {passes_cpu:.6f}\n")
            out.flush()

        hooks.time_train_steps(write)
        sys.argv = ["fairseq-train", *argv]
        train_cli.cli_main()
    return 0


def run_fairseq(workdir: str, optimizers: Sequence[str], reps: int, max_update: int, threads: int,
                log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    data = prepare_fairseq_data(workdir, log=log)
    # the runs are --cpu: where a GPU is, fairseq's gradient norm would go through it (recipe.cpu_only_env)
    env = child_env(nmt.cpu_only_env(dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))))
    log_interval = max(max_update // 8, 2)
    skip = min(3, max_update // 4)  # warm-up updates left out of the per-update medians
    runs: Dict[str, List[float]] = {o: [] for o in optimizers}  # fairseq's ups (wall clock)
    cpu: Dict[str, List[float]] = {o: [] for o in optimizers}  # CPU seconds per train_step
    paired: Dict[str, List[float]] = {o: [] for o in optimizers}  # per repeat: median over steps of o/adam
    step_parts: Dict[str, List[List[tuple]]] = {}  # per run: (update CPU s, passes, fwd/bwd CPU s) per update
    for rep in range(reps):
        k = rep % len(optimizers)
        step_times: Dict[str, List[float]] = {}
        for o in list(optimizers)[k:] + list(optimizers)[:k]:
            cmd = fairseq_command(data, o, max_update, os.path.join(workdir, f"ckpt-{o}"), log_interval)
            step_log = os.path.join(workdir, f"steps-{o}.txt")
            child = [sys.executable, "-m", "vasso_bench.fairseq_runs", step_log, "--", *cmd[1:]]
            proc = subprocess.run(child, capture_output=True, text=True, env=env, timeout=900)
            text = proc.stdout + "\n" + proc.stderr
            ups = fairseq_ups(text)
            try:
                with open(step_log, encoding="utf-8") as f:
                    rows = [line.split() for line in f if line.strip()]
            except FileNotFoundError:
                rows = []
            steps = [float(r[0]) for r in rows]
            if all(len(r) >= 4 for r in rows):
                step_parts.setdefault(o, []).append([(float(r[0]), int(r[2]), float(r[3])) for r in rows])
            if not ups or len(steps) <= skip:
                raise RuntimeError(f"fairseq-train --optimizer {o} did not train "
                                   f"(rc {proc.returncode}):\n{text[-3000:]}")
            runs[o].append(median(ups))
            cpu[o].append(median(steps[skip:]))
            step_times[o] = steps
        if "adam" in step_times:
            # same --seed, same data order: update i sees the same batch in every run, so the
            # per-update ratios pair like with like (batch sizes vary a lot under --max-tokens)
            for o in optimizers:
                paired[o].append(median([a / b for a, b in zip(step_times[o][skip:], step_times["adam"][skip:])
                                         if b > 0]))
        log(f"  fairseq repeat {rep + 1}/{reps}: " + ", ".join(
            f"{o} {1e3 * cpu[o][-1]:.0f} ms CPU/update, {runs[o][-1]:.2f} ups" for o in optimizers))
    out: Dict[str, Any] = {"ups": {o: median(v) for o, v in runs.items()}, "ups_all": runs,
                           "cpu_ms": {o: 1e3 * median(v) for o, v in cpu.items()},
                           "cpu_ms_all": {o: [1e3 * x for x in v] for o, v in cpu.items()},
                           "command": shlex.join(fairseq_command("DATA", "vasso", max_update, "SAVE", log_interval))}
    for o in optimizers:
        if o != "adam":
            out[f"{o}_time_over_adam"] = median(paired[o])
            out[f"{o}_time_over_adam_all"] = paired[o]
            out[f"{o}_ups_time_over_adam"] = median([a / b for a, b in zip(runs["adam"], runs[o]) if b > 0])
    if "sam" in runs and "vasso" in runs:
        out["vasso_time_over_sam"] = median([v / s for s, v in zip(paired["sam"], paired["vasso"]) if s > 0])
    out.update(fairseq_from_parts(step_parts, skip))
    return out


def fairseq_from_parts(step_parts: Dict[str, List[List[tuple]]], skip: int) -> Dict[str, Any]:
    """The fairseq ratios from the timed parts, as for the micro-benchmark: forward/backward of
    update i costs the same in every run (same batch), so take it once for all runs (the median
    CPU time per pass of update i over every run and pass) and add each run's own remainder
    (update - its forward/backward: fairseq's bookkeeping, the optimizer step, and for sam/vasso
    the perturbation, restore, RNG replay and diagnostics).  The processes' CPU speeds, which a
    loaded machine changes from run to run, then no longer enter the ratio."""
    if "adam" not in step_parts:
        return {}
    n = min(len(run) for runs in step_parts.values() for run in runs)
    per_pass = []
    for i in range(n):
        costs = [run[i][2] / run[i][1] for runs in step_parts.values() for run in runs if run[i][1] > 0]
        per_pass.append(median(costs))
    rest = {o: [median([run[i][0] - run[i][2] for run in runs]) for i in range(n)] for o, runs in step_parts.items()}
    npass = {o: [median([run[i][1] for run in runs]) for i in range(n)] for o, runs in step_parts.items()}

    def cost(o, i):
        return npass[o][i] * per_pass[i] + rest[o][i]

    out: Dict[str, Any] = {"fwdbwd_ms_per_pass": 1e3 * median(per_pass[skip:]),
                           "rest_ms": {o: 1e3 * median(r[skip:]) for o, r in rest.items()}}
    for o in step_parts:
        if o != "adam":
            out[f"{o}_over_adam_from_parts"] = median([cost(o, i) / cost("adam", i) for i in range(skip, n)])
    if "sam" in step_parts and "vasso" in step_parts:
        out["vasso_over_sam_from_parts"] = median([cost("vasso", i) / cost("sam", i) for i in range(skip, n)])
    return out


def main(argv=None):
    return fairseq_child(*nmt.child_argv(argv, "vasso_bench.fairseq_runs", "STEP_LOG"))


if __name__ == "__main__":
    sys.exit(main())
