"""fairseq user-dir: ``--optimizer sam`` and ``--optimizer vasso`` on stock fairseq-train.

    fairseq-train DATA --user-dir fairseq_vasso --optimizer vasso --rho 0.1 --theta 0.4 ...

The plugin is this package's root, in the shape of fairseq's own ``optim/adam.py``:

* :mod:`fairseq_vasso.optimizer`: the optimizers ``sam`` and ``vasso`` (a dataclass
  config whose fields are the flags, and a small ``FairseqOptimizer`` subclass over
  fairseq's AdamW; the math comes from ``plugins``);
* :mod:`fairseq_vasso.hooks`: every patch of fairseq (argument parsing, ``--help``,
  ``Trainer``), inert for every other optimizer: it checks our flags and refuses
  unsupported modes right after the command line is parsed (one line, exit status
  2, before the task, model or data are built) and runs the second forward/backward
  pass inside ``Trainer.train_step``;
* ``argparse.Namespace`` allow-listed for ``torch.load(weights_only=True)`` at import,
  so that fairseq checkpoints load with torch's protection on (torch >= 2.6 refuses
  them otherwise).

Importing this package imports no fairseq: it registers the optimizers and installs
the hooks as soon as fairseq is imported, at once when fairseq already is (as under
``--user-dir``, which fairseq imports after itself), else right after fairseq's own
import completes.  So the translation tools of :mod:`fairseq_vasso.nmt`, which drive
fairseq through its console scripts, import neither fairseq nor the hooks, while a
script that imports this package and then fairseq finds ``sam`` and ``vasso``
registered.  :func:`register` does it at once.

The installed folder to pass to ``--user-dir``::

    python -c "import fairseq_vasso, os; print(os.path.dirname(fairseq_vasso.__file__))"
"""

import argparse
import importlib.abc
import importlib.util
import sys

import torch

from ._foreign_warnings import silence_foreign_warnings

# before fairseq-train reaches Hydra (it imports the user-dir first): see the module
silence_foreign_warnings()
if hasattr(torch.serialization, "add_safe_globals"):  # fairseq checkpoints hold a Namespace
    torch.serialization.add_safe_globals([argparse.Namespace])

__all__ = ["register"]


def register() -> None:
    """Register ``--optimizer sam|vasso`` with fairseq and install the hooks
    (:mod:`fairseq_vasso.hooks`); idempotent.  Imports fairseq."""
    from . import hooks, optimizer  # noqa: F401  (registering and patching are their import)

    if hasattr(torch.serialization, "add_safe_globals"):
        # --ddp-backend fully_sharded: FSDP's load_state_dict broadcasts rank 0's checkpoint with
        # torch.save / torch.load, tensors replaced by this placeholder (an index), which torch.load's
        # weights_only default refuses on the other ranks
        try:
            from fairseq.distributed.utils import _TensorPlaceholder
        except ImportError:  # another fairseq: hooks.check_fairseq_internals has said so already
            return
        torch.serialization.add_safe_globals([_TensorPlaceholder])


class _RegisterAfterFairseq(importlib.abc.MetaPathFinder):
    """Calls :func:`register` right after ``import fairseq`` completes, once."""

    def find_spec(self, name, path=None, target=None):
        if name != "fairseq":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            exec_fairseq = spec.loader.exec_module

            def exec_then_register(module):
                exec_fairseq(module)
                register()

            spec.loader.exec_module = exec_then_register
        return spec


if "fairseq" in sys.modules:  # --user-dir, or a process that imported fairseq first
    register()
elif not any(isinstance(f, _RegisterAfterFairseq) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterFairseq())
