"""The anchors: the authors' VASSO (BingcongLi/VaSSO, ``solver/vasso.py``) and davda54's SAM
(davda54/sam, ``sam.py``), imported at run time from checkouts the user points at
(``scripts/benchmark/benchmark.py --reference-vasso DIR --reference-sam DIR``).  Their code is never
copied into this repository.

Both expose ``first_step(zero_grad)`` / ``second_step(zero_grad)`` around the caller's own
forward/backward passes; they differ in how the base optimizer is given (an instance for the
authors' VASSO, a class and its keyword arguments for davda54's SAM).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from typing import Callable, Dict, Tuple

#: flag -> (what it points at, the file that must be there, the class it provides)
ANCHORS: Dict[str, Tuple[str, str, str]] = {
    "--reference-vasso": ("a checkout of BingcongLi/VaSSO", os.path.join("solver", "vasso.py"), "VASSO"),
    "--reference-sam": ("a checkout of davda54/sam", "sam.py", "SAM"),
}
#: the top-level package names the authors' VaSSO checkout imports itself by
_VASSO_PACKAGES = ("solver", "utils")


class AnchorError(ValueError):
    """A checkout that is missing, lacks the expected file, or does not import; the
    message names the flag."""


def check_dir(flag: str, path: str) -> str:
    """The file the anchor lives in, or AnchorError naming ``flag``."""
    what, rel, _ = ANCHORS[flag]
    if not os.path.isdir(path):
        raise AnchorError(f"{flag} {path}: no such folder (give {what})")
    file = os.path.join(path, rel)
    if not os.path.isfile(file):
        raise AnchorError(f"{flag} {path}: has no {rel} (give {what})")
    return file


def _import_vasso(path: str) -> type:
    """``solver.vasso.VASSO`` from ``path``: the checkout imports itself as the generic
    top-level packages ``solver`` and ``utils``, so those names are lent to it for the
    import only (this process's own modules of those names, if any, are put back)."""
    def ours(name):
        return any(name == p or name.startswith(p + ".") for p in _VASSO_PACKAGES)

    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, path)
    try:
        return importlib.import_module("solver.vasso").VASSO
    finally:
        sys.path.remove(path)
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def _import_sam(file: str) -> type:
    spec = importlib.util.spec_from_file_location("_anchor_davda54_sam", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SAM


def load(flag: str, path: str) -> type:
    """The anchor's optimizer class from the user's checkout (AnchorError naming ``flag``
    when the folder, the file or the import fails)."""
    file = check_dir(flag, path)
    try:
        cls = _import_vasso(os.path.abspath(path)) if flag == "--reference-vasso" else _import_sam(file)
    except Exception as e:  # the user's code: any failure is reported against the flag
        raise AnchorError(f"{flag} {path}: importing {ANCHORS[flag][1]} failed: {type(e).__name__}: {e}") from e
    for method in ("first_step", "second_step"):
        if not callable(getattr(cls, method, None)):
            raise AnchorError(f"{flag} {path}: {ANCHORS[flag][2]} in {ANCHORS[flag][1]} has no {method}()")
    return cls


def build(flag: str, cls: type, params, base: Callable, base_kw: Dict, rho: float, theta: float):
    """The anchor optimizer over ``base`` (a torch optimizer class) the way its own code
    builds it."""
    params = list(params)
    if flag == "--reference-vasso":
        return cls(params, base_optimizer=base(params, **base_kw), rho=rho, theta=theta)
    return cls(params, base, rho=rho, adaptive=False, **base_kw)


def provenance(path: str) -> str:
    """Where an anchor came from: its folder and, for a git checkout, the commit."""
    commit = ""
    try:
        proc = subprocess.run(["git", "-C", path, "rev-parse", "--show-toplevel", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30)
        top, _, head = proc.stdout.strip().partition("\n")
        # a copy inside another repository (no .git of its own) would report that repository's commit
        if proc.returncode == 0 and os.path.realpath(top) == os.path.realpath(path):
            commit = head.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{os.path.abspath(path)} (" + (f"git {commit}" if commit else "not a git checkout") + ")"
