"""Sharpness-aware minimization family (SAM, VASSO, eSAM/eVASSO, ASAM, GSAM) over any
torch optimizer.  Torch only: the fairseq and DomainBed integrations build on this.

The core is this package's root: ``optimizer`` (the family and its two-pass protocol),
``perturbation`` (each formula once, over lists of tensors), ``reductions`` (the step's
fused sums), ``distributed`` (where tensors live across ranks, the exchange),
``scaling`` (loss scaling), ``diagnostics``, ``state`` (the state dict), ``inflight``
(the step between its two halves), ``validation`` (each knob's range, one ``check``),
``named_params``.
Experiments, benchmarks and plots live in :mod:`plugins.lab`, which the core never imports.

    >>> import torch
    >>> from plugins import VASSO
    >>> opt = VASSO(torch.nn.Linear(2, 1).parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=5e-4)
    >>> type(opt.base_optimizer).__name__
    'AdamW'
"""

from .distributed import PartitionGroup
from .optimizer import SAM, VASSO, SharpnessAware
from .perturbation import frozen_running_stats, rng_state, set_rng_state

__all__ = ["SAM", "VASSO", "SharpnessAware", "PartitionGroup", "frozen_running_stats", "rng_state", "set_rng_state"]
__version__ = "0.1.0"
