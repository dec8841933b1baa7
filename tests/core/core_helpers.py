"""Small models and data shared by the core tests."""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from plugins import SAM, VASSO


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


# ------------------------------------------------------------------ host synchronizations


class CountSyncs(TorchDispatchMode):
    """Counts host syncs as the dispatcher sees them: every ``aten._local_scalar_dense``
    (``item``, ``float``, ``bool``, ``int`` on a tensor) plus ``Tensor.tolist``, which
    outside such a mode copies without dispatching an op (patched for the duration of
    the block, and counted once whatever it dispatches inside)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._in_tolist = False
        self._tolist = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self._in_tolist:
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist
        counter = self

        def tolist(tensor):
            if counter._in_tolist:  # re-entered through a TorchFunctionMode: one call, one count
                return original(tensor)
            counter.count += 1
            counter._in_tolist = True
            try:
                return original(tensor)
            finally:
                counter._in_tolist = False

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


#: The Python-level calls that copy a tensor's value to the host, by name (``tolist``
#: may be patched by :class:`CountSyncs`).
SYNC_CALLS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}


class CountSyncCalls(TorchFunctionMode):
    """A second opinion at the Python level: the calls that copy a tensor's value to the
    host (a device sync on GPUs), ``cpu()`` and ``numpy()`` included."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in SYNC_CALLS:
            self.count += 1
        return func(*args, **(kwargs or {}))
