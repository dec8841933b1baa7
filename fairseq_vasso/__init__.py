"""fairseq user-dir: ``--optimizer sam`` and ``--optimizer vasso`` on stock fairseq-train.

    fairseq-train DATA --user-dir fairseq_vasso --optimizer vasso --rho 0.1 --theta 0.4 ...

Importing this package (fairseq does it for ``--user-dir``):

* registers the optimizers ``sam`` and ``vasso`` (:mod:`fairseq_vasso.optimizer`), an
  AdamW base with fairseq's ``adam`` flags, the math coming from ``plugins/``, and
  checks their flags as soon as fairseq has parsed the command line (one line,
  exit code 2, before the task, model or data are built);
* hooks :class:`fairseq.trainer.Trainer` (:mod:`fairseq_vasso.trainer_hooks`) so that
  a training step with one of these optimizers runs the second forward/backward pass;
  with any other optimizer the hooks call fairseq's own code and nothing else;
* allow-lists ``argparse.Namespace`` for ``torch.load(weights_only=True)`` so that
  fairseq checkpoints load with torch's protection on (torch >= 2.6 refuses them
  otherwise); weights_only itself is left on.

The installed folder to pass to ``--user-dir``::

    python -c "import fairseq_vasso, os; print(os.path.dirname(fairseq_vasso.__file__))"
"""

import argparse

import torch

from ._foreign_warnings import silence_foreign_warnings

# before fairseq-train reaches Hydra (it imports the user-dir first): see the module
silence_foreign_warnings()

if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([argparse.Namespace])

from . import optimizer  # noqa: E402,F401  (registers sam / vasso)
from . import trainer_hooks  # noqa: E402,F401  (second pass in Trainer.train_step)
from ._help import add_flags_to_help as _add_flags_to_help  # noqa: E402

_add_flags_to_help({"sam": optimizer.FairseqSAMConfig, "vasso": optimizer.FairseqVASSOConfig})
optimizer.check_command_line()

__all__ = ["optimizer", "trainer_hooks"]
