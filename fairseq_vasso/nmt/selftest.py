"""``vasso-selftest``'s fairseq check: a short ``fairseq-train --user-dir fairseq_vasso
--optimizer vasso`` on a tiny generated corpus, run as a user runs it (subprocesses:
``fairseq_cli.preprocess``, then ``fairseq_cli.train``), in one precision mode on one device.

It holds when the loss falls, the diagnostics fairseq logs are finite, and the base
optimizer sees the gradient unscaled exactly once: with ``--clip-norm`` below every
update's gradient norm, the gradient at each base step has norm ``--clip-norm`` (one
unscale too many divides it by the loss scale, none multiplies it).  The base steps are
recorded by a child (``python -m fairseq_vasso.nmt.selftest RECORD -- ARGS``) that
registers torch's global optimizer step pre-hook, then runs fairseq-train's own
``cli_main``: fairseq itself is not patched.  Importing this module imports no fairseq.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence

from plugins.lab.selftest.checks import CheckFailed, Skipped

from .logs import parse_fairseq_log_text
from .recipe import child_argv, toy_train_args
from .toy_corpus import write_corpus

#: precision mode -> fairseq-train flags (fp32 on the CPU, the loss-scaled modes on CUDA)
MODES = {"fp32": [], "fp16": ["--fp16"], "amp": ["--amp"],
         "memory-efficient-fp16": ["--fp16", "--memory-efficient-fp16"]}
CUDA_MODES = ("fp16", "amp", "memory-efficient-fp16")
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
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if device.startswith("cuda"):
        env["CUDA_VISIBLE_DEVICES"] = str(int(device.split(":")[1]) if ":" in device else 0)
    return env


def _run(cmd: Sequence[str], env: Dict[str, str], what: str) -> str:
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=TIMEOUT,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what} did not finish in {TIMEOUT} s", {"command": list(cmd)})
    text = proc.stdout + "\n" + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-15:])
        raise CheckFailed(f"{what} failed (exit {proc.returncode}): {tail.splitlines()[-1] if tail else ''}",
                          {"command": list(cmd), "output_tail": tail})
    return text


def prepare_data(workdir: str) -> str:
    """The binarized toy corpus under ``workdir`` (made once)."""
    data = os.path.join(workdir, "data-bin")
    if os.path.exists(os.path.join(data, "dict.de.txt")):
        return data
    raw = os.path.join(workdir, "raw")
    write_corpus(raw, n_train=300, n_valid=20, n_test=20, seed=1)
    _run([sys.executable, "-m", "fairseq_cli.preprocess", "--source-lang", "de", "--target-lang", "en",
          "--trainpref", os.path.join(raw, "train"), "--validpref", os.path.join(raw, "valid"),
          "--testpref", os.path.join(raw, "test"), "--destdir", data, "--joined-dictionary", "--workers", "1"],
         _env("cpu"), "fairseq-preprocess")
    return data


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


def check_fairseq(device: str, mode: str, workdir: str):
    """The check in one precision mode on one device (``"cpu"`` or ``"cuda:i"``)."""
    why = fairseq_missing()
    if why:
        raise Skipped(why)
    data = prepare_data(workdir)
    run_dir = os.path.join(workdir, f"{device.replace(':', '')}-{mode}")
    os.makedirs(run_dir, exist_ok=True)
    record = os.path.join(run_dir, "base_steps.jsonl")
    cmd = [sys.executable, "-m", "fairseq_vasso.nmt.selftest", record, "--",
           *train_args(data, os.path.join(run_dir, "checkpoints"), device, mode)]
    text = _run(cmd, _env(device), f"fairseq-train --optimizer vasso {' '.join(MODES[mode]) or '(fp32)'}")
    with open(record, encoding="utf-8") as f:
        norms = [json.loads(line)["grad_norm"] for line in f if line.strip()]
    figure, details = judge(parse_fairseq_log_text(text), norms, mode)
    details["command"] = "fairseq-train " + " ".join(cmd[4:])
    return figure, details


def child(record: str, argv: Sequence[str]) -> int:
    """fairseq-train in this process, with the gradient norm of every base optimizer step
    (every torch optimizer that wraps none) appended to ``record``."""
    import torch
    from fairseq_cli import train as train_cli

    out = open(record, "w", encoding="utf-8")

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
    return child(*child_argv(argv, "fairseq_vasso.nmt.selftest", "RECORD"))


if __name__ == "__main__":
    sys.exit(main())
