"""The CPU kernels pinned for the numbers the docs state exactly: the same bits on the x86-64
CPUs of the vendor they were measured on (:data:`MEASURED_VENDORS`), AVX2 or AVX512, for one
torch build.

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

The pin does not make every CPU agree: on the Intel Xeons measured (with AMX and without) the
pinned kernels round otherwise than on AMD's (one float32 ulp in the first step of
``tests/core/test_numerics_pin.py``, with MKL on its COMPATIBLE path there; neither glibc's CPU
dispatch nor MKL's other switches move it).
So the checks of the documented numbers run where :func:`unmeasured` is None and skip
elsewhere, saying why; the pins of the core's trajectories (``tests/core/test_numerics_pin.py``)
are kept per CPU kind (:func:`cpu_kind`).
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


#: where Linux describes the CPUs
CPUINFO = "/proc/cpuinfo"


def _first_cpu():
    """Each field of :data:`CPUINFO` at its first occurrence, the first CPU's
    (``{"vendor_id": "GenuineIntel", ...}``), or ``{}`` where it cannot be read."""
    found = {}
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, colon, value = line.partition(":")
                if colon:
                    found.setdefault(name.strip(), value.strip())
    except OSError:
        return {}
    return found


def _cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo, or None where it cannot be read."""
    flags = _first_cpu().get("flags")
    return None if flags is None else set(flags.split())


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


# the CPU vendors (/proc/cpuinfo's vendor_id) whose pinned kernels gave the documented numbers
MEASURED_VENDORS = ("AuthenticAMD",)


def vendor():
    """This CPU's vendor as /proc/cpuinfo names it (``AuthenticAMD``, ``GenuineIntel``), or None."""
    return _first_cpu().get("vendor_id")


def cpu_kind():
    """This CPU's kind as /proc/cpuinfo names it: vendor, family and model (``GenuineIntel 6/167``),
    or None where it cannot be read. A virtual machine may report a model other than the host's."""
    cpu = _first_cpu()
    found = [cpu.get(field) for field in ("vendor_id", "cpu family", "model")]
    return None if None in found else f"{found[0]} {found[1]}/{found[2]}"


def unmeasured():
    """Why the documented exact numbers are not expected here (the pin cannot apply, or the
    CPU's vendor is not one they were measured on), or None where they are."""
    why = unavailable()
    if why is not None:
        return why
    found = vendor()
    if found not in MEASURED_VENDORS:
        return (f"the documented numbers were measured on {' and '.join(MEASURED_VENDORS)} CPUs with the kernels "
                f"pinned; this CPU is {found}'s, on which they were seen to round otherwise")
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
