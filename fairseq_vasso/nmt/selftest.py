"""``vasso-selftest``'s fairseq check: a short ``fairseq-train --user-dir fairseq_vasso
--optimizer vasso`` on a tiny generated corpus, run as a user runs it (subprocesses:
``fairseq_cli.preprocess``, then ``fairseq_cli.train``), in one precision mode on one device.
One child per (device, mode) binarizes the corpus and trains in one fairseq start-up, and
the children of a self-test run side by side (:class:`Runs`); the CPU's runs with CUDA
hidden (``CUDA_VISIBLE_DEVICES=``), as fairseq's ``--cpu`` needs where a GPU is.

It holds when the loss falls, the diagnostics fairseq logs are finite, and the base
optimizer sees the gradient unscaled exactly once: with ``--clip-norm`` below every
update's gradient norm, the gradient at each base step has norm ``--clip-norm`` (one
unscale too many divides it by the loss scale, none multiplies it).  The base steps are
recorded by a child (``python -m fairseq_vasso.nmt.selftest JOB -- ARGS``) that
registers torch's global optimizer step pre-hook, then runs fairseq-train's own
``cli_main``: fairseq itself is not patched.  Importing this module imports no fairseq.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from plugins.lab.selftest.checks import CheckFailed, Skipped

from .logs import parse_fairseq_log_text
from .recipe import child_argv, cpu_only_env, toy_train_args
from .toy_corpus import write_corpus

#: precision mode -> fairseq-train flags (fp32 on the CPU and on CUDA, the loss-scaled modes on CUDA)
MODES = {"fp32": [], "fp16": ["--fp16"], "amp": ["--amp"],
         "memory-efficient-fp16": ["--fp16", "--memory-efficient-fp16"]}
CUDA_MODES = ("fp32", "fp16", "amp", "memory-efficient-fp16")
CLIP = 0.05
UPDATES = 12
DIAGNOSTICS = ("ascent_norm", "sharpness", "stability", "loss_gap")
#: relative tolerance of the base step's gradient norm against --clip-norm
NORM_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "amp": 1e-2, "memory-efficient-fp16": 1e-2}
TIMEOUT = 300


def fairseq_missing() -> Optional[str]:
    """Why the check cannot run, or None."""
    if importlib.util.find_spec("fairseq") is None:
        return "fairseq not installed (pip install --no-build-isolation fairseq-fixed==0.12.3.1)"
    return None


def _env(device: str) -> Dict[str, str]:
    """The child's environment: this package first on PYTHONPATH, one thread, and only the
    device it runs on visible: none for the CPU (:func:`~fairseq_vasso.nmt.recipe.cpu_only_env`:
    fairseq's ``--cpu`` still puts the gradient norm of ``--clip-norm`` on
    ``torch.cuda.current_device()`` wherever CUDA is available)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = str(int(device.split(":")[1]) if ":" in device else 0)
        return env
    return cpu_only_env(env)


#: A failing run's one line of what to do, by what its output says (the first match), else the last.
HINTS = (
    ("expected to be on cpu but is on cuda",
     "fairseq's clip_grad_norm_ puts the norm on CUDA whenever a GPU is visible, --cpu or not: run "
     "fairseq-train --cpu with CUDA_VISIBLE_DEVICES= (empty), as this check's child does"),
    ("CUDA out of memory", "another process holds the GPU's memory (nvidia-smi): run again on an idle GPU"),
    ("", "run the command in the JSON report's details (fairseq-train ...) to see fairseq's whole output"),
)


def hint_for(output: str) -> str:
    return next(hint for needle, hint in HINTS if needle in output)


def _run(cmd: Sequence[str], env: Dict[str, str], what: str, shown: Optional[str] = None) -> str:
    """The child's output; :class:`CheckFailed` with a hint when it fails. ``shown``: the
    command as a user reruns it, for the report."""
    where = {"command": shown or " ".join(cmd), "child": list(cmd)}
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what} did not finish in {TIMEOUT} s", where,
                          hint="run the command in the JSON report's details by hand (a toy run takes under "
                               "a minute): is the machine busy?")
    text = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise CheckFailed(f"{what} failed (exit {proc.returncode}): {tail.splitlines()[-1] if tail else ''}",
                          dict(where, output_tail=tail), hint=hint_for(text))
    return text


def write_raw_corpus(workdir: str) -> str:
    """The toy corpus as text under ``workdir`` (written once; no fairseq needed)."""
    raw = os.path.join(workdir, "raw")
    if not os.path.exists(os.path.join(raw, "test.en")):
        write_corpus(raw, n_train=300, n_valid=20, n_test=20, seed=1)
    return raw


def preprocess_args(raw: str, data: str) -> List[str]:
    """fairseq-preprocess's arguments: ``raw``'s corpus binarized into ``data``."""
    return ["--source-lang", "de", "--target-lang", "en", "--trainpref", os.path.join(raw, "train"),
            "--validpref", os.path.join(raw, "valid"), "--testpref", os.path.join(raw, "test"),
            "--destdir", data, "--joined-dictionary", "--workers", "1"]


def train_args(data: str, save_dir: str, device: str, mode: str, extra: Sequence[str] = ()) -> List[str]:
    """fairseq-train's arguments: a 1+1-layer transformer of width 32, vasso, ``UPDATES`` updates."""
    args = toy_train_args(data, save_dir, optimizer_flags=["--optimizer", "vasso", "--rho", "0.1", "--theta", "0.4"],
                          lr=3e-3, max_update=UPDATES)
    args += ["--clip-norm", str(CLIP), "--no-save", "--disable-validation", *MODES[mode], *extra]
    if device == "cpu":
        args.append("--cpu")
    return args


def judge(records: List[Dict], base_norms: List[float], mode: str, clip: float = CLIP):
    """(figure, details) of a run from its ``train_inner`` records and the gradient norms its
    base optimizer saw; :class:`CheckFailed` when the loss did not fall, a diagnostic is not
    finite, or a base step saw a gradient other than the clipped one."""
    inner = [r for r in records if r.get("_tag") == "train_inner"]
    losses = [float(r["loss"]) for r in inner if "loss" in r]
    details: Dict = {"mode": mode, "losses": losses, "base_step_grad_norms": base_norms, "clip_norm": clip}
    problems = []
    if len(losses) < 6:
        problems.append(f"only {len(losses)} updates logged")
    elif not sum(losses[-3:]) < sum(losses[:3]):
        problems.append(f"the loss did not fall ({losses[0]:.3f} ... {losses[-1]:.3f})")
    # the stability ||eps_t - eps_{t-1}|| exists from the second update on
    bad = sorted({k for i, r in enumerate(inner) for k in DIAGNOSTICS if k in r and (i > 0 or k != "stability")
                  and not (isinstance(r[k], float) and math.isfinite(r[k]))})
    missing = [k for k in DIAGNOSTICS if not any(k in r for r in inner)]
    if bad or missing:
        problems.append("diagnostics " + ", ".join(f"{k} not finite" for k in bad)
                        + ", ".join(f"{k} not logged" for k in missing))
    gnorms = [float(r["gnorm"]) for r in inner if "gnorm" in r]
    details["gnorm"] = gnorms
    scales = [float(r["loss_scale"]) for r in inner if "loss_scale" in r]
    details["loss_scale"] = scales
    tol = NORM_TOLERANCE[mode]
    off = [n for n in base_norms if not abs(n / clip - 1.0) <= tol]
    if not base_norms:
        problems.append("the base optimizer never stepped")
    elif off:
        problems.append(f"the base optimizer saw gradient norms {off[:3]} where the clipped gradient has "
                        f"{clip} (unscaled once)")
    if gnorms and min(gnorms) <= clip:
        problems.append(f"an update's gradient norm {min(gnorms):.3g} is below --clip-norm {clip}: the check "
                        "cannot tell the unscaling")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    scale = f", loss scale {scales[-1]:g}" if scales else ""
    figure = (f"loss {losses[0]:.2f} -> {losses[-1]:.2f} in {len(losses)} updates, diagnostics finite, the base "
              f"step's gradient norm = --clip-norm {clip} on {len(base_norms)}/{len(base_norms)} steps "
              f"(unscaled once{scale})")
    return figure, details


def _start(device: str, mode: str, workdir: str) -> Tuple[List[str], Dict[str, str], str]:
    """The child's command, environment and job file for one (device, mode): it binarizes
    the corpus into its own folder and trains there, in one fairseq start-up."""
    raw = write_raw_corpus(workdir)
    run_dir = os.path.join(workdir, f"{device.replace(':', '')}-{mode}")
    os.makedirs(run_dir, exist_ok=True)
    data = os.path.join(run_dir, "data-bin")
    job = os.path.join(run_dir, "job.json")
    with open(job, "w", encoding="utf-8") as f:
        json.dump({"record": os.path.join(run_dir, "base_steps.jsonl"), "preprocess": preprocess_args(raw, data)}, f)
    cmd = [sys.executable, "-m", "fairseq_vasso.nmt.selftest", job, "--",
           *train_args(data, os.path.join(run_dir, "checkpoints"), device, mode)]
    return cmd, _env(device), job


def check_fairseq(device: str, mode: str, workdir: str):
    """The check in one precision mode on one device (``"cpu"`` or ``"cuda:i"``): one child."""
    why = fairseq_missing()
    if why:
        raise Skipped(why)
    cmd, env, job = _start(device, mode, workdir)
    # as a user reruns it (after fairseq-preprocess with the job's arguments)
    shown = f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} fairseq-train " + " ".join(cmd[5:])
    t0 = time.perf_counter()
    text = _run(cmd, env, f"fairseq-train --optimizer vasso {' '.join(MODES[mode]) or '(fp32)'}", shown)
    with open(job, encoding="utf-8") as f:
        record = json.load(f)["record"]
    with open(record, encoding="utf-8") as f:
        norms = [json.loads(line)["grad_norm"] for line in f if line.strip()]
    figure, details = judge(parse_fairseq_log_text(text), norms, mode)
    details["command"] = shown
    details["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"]
    details["child_seconds"] = round(time.perf_counter() - t0, 1)
    return figure, details



def parallel_children(jobs: int) -> int:
    """How many children run at once: one per two cores (each has one thread, and fairseq
    starts a loader), at least one."""
    return max(1, min(jobs, (os.cpu_count() or 1) // 2))


class Runs:
    """The fairseq checks of one self-test: every (device, mode) child starts, side by side
    (at most :func:`parallel_children` at once), when the first is asked for; each
    :meth:`check` waits for its own.  A row's time is then its wait; the child's own time
    is in its details (``child_seconds``)."""

    def __init__(self, cases: Sequence[Tuple[str, str]], workdir: str, parallel: Optional[int] = None):
        self.cases, self.workdir = list(cases), workdir
        self.parallel = parallel or parallel_children(len(self.cases))
        self._futures: Dict[Tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def _submit_all(self):
        with self._lock:
            if self._futures:
                return
            why = fairseq_missing()
            if why:
                raise Skipped(why)
            write_raw_corpus(self.workdir)  # once, before the children share it
            pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.parallel,
                                                        thread_name_prefix="fairseq-selftest")
            for device, mode in self.cases:
                self._futures[(device, mode)] = pool.submit(check_fairseq, device, mode, self.workdir)
            pool.shutdown(wait=False)

    def check(self, device: str, mode: str):
        self._submit_all()
        return self._futures[(device, mode)].result()

    def wait(self):
        """Every child finished (the checks after these time the device)."""
        concurrent.futures.wait(list(self._futures.values()))


def child(job: str, argv: Sequence[str]) -> int:
    """fairseq-preprocess (when the job names its arguments), then fairseq-train, in this
    process, with the gradient norm of every base optimizer step (every torch optimizer that
    wraps none) appended to the job's record."""
    import torch
    from fairseq_cli import train as train_cli

    with open(job, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("preprocess"):
        from fairseq_cli import preprocess as preprocess_cli

        sys.argv = ["fairseq-preprocess", *spec["preprocess"]]
        preprocess_cli.cli_main()
    out = open(spec["record"], "w", encoding="utf-8")

    def pre_step(optimizer, args, kwargs):
        if hasattr(optimizer, "base_optimizer"):  # the core itself: its base steps below
            return
        grads = [q.grad.detach().float() for g in optimizer.param_groups for q in g["params"] if q.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
            if grads else 0.0
        out.write(json.dumps({"optimizer": type(optimizer).__name__, "grad_norm": norm}) + "\n")
        out.flush()

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(pre_step)
    sys.argv = ["fairseq-train", *argv]
    try:
        train_cli.cli_main()
    finally:
        out.close()
    return 0


def main(argv=None):
    return child(*child_argv(argv, "fairseq_vasso.nmt.selftest", "JOB"))


if __name__ == "__main__":
    sys.exit(main())
