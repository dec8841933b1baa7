"""Small models and data shared by the core tests."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plugins import SAM, VASSO


class Dispatched(TorchDispatchMode):
    """Records each dispatched op whose name (its overload packet's) is one of ``names``:
    the names in ``seen``, ``(name, args)`` in ``calls``."""

    def __init__(self, *names: str):
        super().__init__()
        self.names, self.seen, self.calls = names, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.names:
            self.seen.append(name)
            self.calls.append((name, args))
        return func(*args, **(kwargs or {}))


def make_model(seed: int = 0, dropout: float = 0.0, batchnorm: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(6, 16)]
    if batchnorm:
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers)


def make_batches(n: int, seed: int = 1, batch: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)) for _ in range(n)]


def closure_for(opt, model, x, y):
    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return closure


def backward_for(opt, model, x, y, api: str, scaler=None):
    """The forward and backward of one pass for :func:`plugins.lab.selftest.checks.protocol_step`:
    the closure API's clears the gradients itself; with a scaler the loss is scaled."""
    def backward():
        if api == "closure":
            opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss
    return backward


def cpu_scaler(**kw):
    """``torch.amp.GradScaler("cpu")``, or a pytest skip where this torch has none (torch < 2.3)."""
    import pytest

    if not hasattr(torch.amp, "GradScaler"):
        pytest.skip(f"torch {torch.__version__} has no CPU GradScaler")
    return torch.amp.GradScaler("cpu", **kw)


def first_backward(model, x, y):
    """Clear the gradients, then one forward/backward of the cross-entropy loss."""
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


VARIANTS = {
    "SAM": (SAM, {}),
    "ASAM": (SAM, {"adaptive": True}),
    "GSAM": (SAM, {"gsam_alpha": 0.3}),
    "eSAM": (SAM, {"p": 0.5}),
    "VASSO": (VASSO, {}),
    "eVASSO": (VASSO, {"p": 0.5}),
    "V+G": (VASSO, {"gsam_alpha": 0.3}),
    "adaptive eVASSO": (VASSO, {"adaptive": True, "p": 0.5}),
}


def build(kind: str, params, base=torch.optim.AdamW, **kw):
    """The family by name, as the parametrized tests use it; ``kw`` overrides."""
    cls, knobs = VARIANTS[kind]
    return cls(params, base, **{**knobs, **kw})


FAMILY = list(VARIANTS)


def skip_without_cpu_matmul(dtype) -> None:
    """Skips the test where this torch has no ``dtype`` matmul on the CPU (torch 2.1's fp16:
    "addmm_impl_cpu_" not implemented for 'Half')."""
    import pytest

    try:
        torch.nn.functional.linear(torch.ones(1, 1, dtype=dtype), torch.ones(1, 1, dtype=dtype))
    except RuntimeError as exc:
        pytest.skip(f"torch {torch.__version__} has no {dtype} matmul on the CPU ({exc})")


def coin_seed(p: float, skipped: int = 2) -> int:
    """A seed whose coin skips the first ``skipped`` steps and takes the next (p = 1: any)."""
    from plugins.perturbation import second_pass_coin
    if p >= 1.0:
        return 5
    return next(s for s in range(1000) if not any(second_pass_coin(p, s, t) for t in range(skipped))
                and second_pass_coin(p, s, skipped))


def decided_on_device(kind: str, dtype=torch.float32) -> bool:
    """Whether the member's steps are decided on the device (``plugins.ondevice``), the first
    included: parameters of one dtype (fp16/bf16 too), a GradScaler or none, every member
    (``SharpnessAware._decides_on_device``)."""
    return dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def expected_syncs(kind: str, coins, dtype=torch.float32, fused: bool = False):
    """Host syncs of each step, for the coins drawn (``docs/design.md``, "Where a step is decided"): the host
    path reads once in perturb() and once in descend() (once in all when the coin skips);
    a step decided on the device reads only the base optimizer's verdict (1), or nothing
    where the base takes torch's ``found_inf`` (``fused``: 0), with a GradScaler or without,
    but for the base's first step (a fused base makes its state before it looks at
    ``found_inf``) and the step that makes the slope buffers (a non-finite ``g_0`` leaves none):
    those read the verdict (1)."""
    out = []
    for t, (two_pass, device, makes) in enumerate(zip(coins, steps_on_device(kind, coins, dtype),
                                                      makes_slopes(kind, coins))):
        out.append(((0 if fused and t > 0 and not makes else 1) if device else 2 if two_pass else 1))
    return out


def steps_on_device(kind: str, coins, dtype=torch.float32):
    """Which steps are decided on the device: every one, for a member and setting that
    :func:`decided_on_device`."""
    return [decided_on_device(kind, dtype)] * len(coins)


def makes_slopes(kind: str, coins):
    """Which step makes the slope buffers: VASSO's first (``d_t`` is updated on every step),
    SAM's first two-pass one (its slope is the last ascent's ``g_t``)."""
    first = 0 if VARIANTS[kind][0] is VASSO else next((t for t, tp in enumerate(coins) if tp), None)
    return [t == first for t in range(len(coins))]


def fused_adamw_on(device: str = "cpu"):
    """``torch.optim.AdamW`` with ``fused=True`` on ``device``, or a pytest skip where this torch has
    none there (the CPU's came with torch 2.4)."""
    import pytest

    from plugins.lab.selftest.checks import fused_adamw_missing

    missing = fused_adamw_missing(device)
    if missing:
        pytest.skip(missing)
    return torch.optim.AdamW


# ------------------------------------------------------------------ host synchronizations
# The counters live in the package (vasso-selftest counts with the same ones on the CPU).
from plugins.lab.selftest.syncs import SYNC_CALLS, CountSyncCalls, CountSyncs  # noqa: E402,F401
