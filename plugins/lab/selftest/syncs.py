"""Host synchronizations of a step, counted on any device (the CPU included): the counters
``tests/core`` and ``vasso-selftest`` share (docs/design.md, "Where a step is decided").  On a GPU,
``vasso-selftest`` and ``tests/core`` also ask torch itself (:func:`cuda_sync_debug_warnings`)."""

import contextlib
import warnings
from typing import Iterator, List

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


#: What torch's CUDA sync debug mode says at each synchronizing operation in "warn" mode
#: (c10's ``warn_or_error_on_sync``).  Setting the mode also warns, once per process, that
#: "Synchronization debug mode is a prototype feature ...": no sync, so not counted.
CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"


def cuda_sync_warnings(caught) -> List[str]:
    """The messages among the recorded warnings ``caught`` that are synchronizing operations."""
    return [str(w.message) for w in caught if CUDA_SYNC_WARNING in str(w.message)]


@contextlib.contextmanager
def cuda_sync_debug_warnings() -> Iterator[List[str]]:
    """torch's own count on a GPU: inside the block ``torch.cuda.set_sync_debug_mode("warn")``;
    the list it yields holds one message per synchronizing CUDA operation once the block ends."""
    syncs: List[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs.extend(cuda_sync_warnings(caught))
