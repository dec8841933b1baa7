"""The CPU kernels pinned for the numbers the docs state exactly: the same bits on every
x86-64 CPU with AVX2 (AVX2 or AVX512, Intel or AMD) for one torch build.

Torch picks its vectorized kernels for the CPU it runs on (AVX512 where there is one,
else AVX2, ...), and MKL, which does torch's float matrix products on x86-64, picks its
own code path, another on AMD than on Intel. Each sums in its own order, so the same
training gives other numbers on another CPU kind. The processes that produce a
documented number (the quick start, the demo, the numerics pins) run with :data:`PINNED`:

* ``ATEN_CPU_CAPABILITY=avx2``: torch's AVX2 kernels (``torch.backends.cpu.get_cpu_capability()``
  reports ``AVX2``);
* ``MKL_CBWR=COMPATIBLE``: MKL's SSE2 code path in its reproducible mode, the one that gives
  the same results on Intel's and AMD's CPUs (``MKL_CBWR=AVX2`` would not: MKL ignores it on
  a non-Intel CPU and takes its own path there); matrix products get 1.5-2x slower;
* ``ONEDNN_MAX_CPU_ISA=AVX2``: oneDNN's kernels capped at AVX2 (fp32 training on the CPU does
  not call oneDNN today; capped so that it stays so if torch starts to);

on a fixed number of threads (one here: torch and MKL split their sums by thread). These
variables act when torch loads, so they are set in the environment of a new process, never
in one that has imported torch. Where the pin cannot apply (another architecture, a CPU
without AVX2, on which torch would stop at its first AVX2 instruction) :func:`unavailable`
says why. docs/fairseq.md ("Quick start on a CPU") gives :data:`EXPORT` for a shell.
"""

import os
import platform
import subprocess
import sys

PINNED = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# what torch.backends.cpu.get_cpu_capability() reports under PINNED
CAPABILITY = "AVX2"
# the line a user exports in a shell to reproduce the docs' numbers: PINNED and one thread
EXPORT = "export " + " ".join(f"{k}={v}" for k, v in PINNED.items()) + " OMP_NUM_THREADS=1"


def _cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo, or None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def unavailable():
    """Why the pin cannot apply on this machine, or None where it does."""
    machine = platform.machine()
    if machine.lower() not in ("x86_64", "amd64"):
        return f"the pinned kernels are x86-64's (AVX2); this machine is {machine}"
    flags = _cpu_flags()
    if flags is None:
        native = capability(unpinned_env())
        if native not in ("AVX2", "AVX512"):
            return f"torch finds no AVX2 on this CPU (its own kernels: {native})"
    elif not {"avx2", "fma"} <= flags:
        return "this CPU lacks AVX2 (torch's AVX2 kernels need AVX2 and FMA)"
    return None


def pinned_env(base=None, threads=1):
    """``base`` (default ``os.environ``) with :data:`PINNED` and ``threads`` torch and MKL
    threads, for a new process. Refuses where :func:`unavailable` says why."""
    why = unavailable()
    if why is not None:
        raise RuntimeError(f"the CPU kernels cannot be pinned here: {why}")
    env = dict(os.environ if base is None else base)
    env.update(PINNED, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def unpinned_env(base=None):
    """``base`` (default ``os.environ``) without :data:`PINNED`: torch and MKL pick this CPU's own kernels."""
    return {k: v for k, v in (os.environ if base is None else base).items() if k not in PINNED}


def capability(env, python=sys.executable):
    """The CPU capability torch reports in a new ``python`` process started with ``env``."""
    out = subprocess.run([python, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{python} could not report torch's CPU capability (exit {out.returncode}):\n"
                           f"{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]
