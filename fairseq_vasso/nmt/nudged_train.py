"""fairseq-train with every initial weight moved up by a number of units in the last place:
the demo's rounding control (``fairseq_vasso.nmt.demo``, ``--control``).

    python FAIRSEQ_VASSO/nmt/nudged_train.py ULPS -- FAIRSEQ_TRAIN_ARGS...

(or ``python -m fairseq_vasso.nmt.nudged_train``; the demo runs it by path, from the
folder its fairseq-train runs get as ``--user-dir``, so that the fairseq_vasso this
child imports is that one: fairseq refuses a ``--user-dir`` whose module name is
already imported from another folder)

runs fairseq-train in this process, as the ``fairseq-train`` console script does, with one
change: once fairseq's ``Trainer`` holds the freshly initialized model, each of its
parameters is moved ``ULPS`` times to the next float of its dtype towards +inf
(``torch.nextafter``). A run resumed from its ``checkpoint_last.pt`` loads the checkpoint's
weights over the nudged ones, so only a run's start is nudged. ``ULPS`` 0 is stock
fairseq-train (tests/scripts/test_demo.py checks it bit for bit).
"""

import os
import sys

if __name__ == "__main__" and not __package__:  # run by path: import the fairseq_vasso this file is in
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fairseq_vasso.nmt.recipe import child_argv
else:
    from .recipe import child_argv


def nudge_up(parameters, ulps):
    """Moves every tensor of ``parameters`` ``ulps`` floats up (in place, without autograd)."""
    import torch

    with torch.no_grad():
        for q in parameters:
            for _ in range(ulps):
                q.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))))


def main(argv=None):
    first, train_args = child_argv(argv, "fairseq_vasso.nmt.nudged_train", "ULPS")
    try:
        ulps = int(first)
        if ulps < 0:
            raise ValueError
    except ValueError:
        raise SystemExit("nudged_train: ULPS must be an integer >= 0, got %r" % first)
    # fairseq_cli.train first, as the fairseq-train script imports it: it sets up the logging
    # (format, level) on import, which is a no-op once anything else has
    from fairseq_cli import train as train_cli
    from fairseq.trainer import Trainer

    stock_init = Trainer.__init__

    def init_then_nudge(self, cfg, task, model, criterion, *args, **kwargs):
        stock_init(self, cfg, task, model, criterion, *args, **kwargs)
        # the model itself (self.model would build a distributed wrapper early); its parameters()
        # yields a shared tensor (tied embeddings) once, so each weight moves once
        nudge_up(self._model.parameters(), ulps)

    Trainer.__init__ = init_then_nudge
    sys.argv = ["fairseq-train", *train_args]
    train_cli.cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
