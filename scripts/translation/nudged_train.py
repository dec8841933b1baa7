"""fairseq-train with every initial weight moved up by a number of units in the last place:
the demo's rounding control (``demo.py`` beside this file, ``--control``).

    python scripts/translation/nudged_train.py ULPS -- FAIRSEQ_TRAIN_ARGS...

runs fairseq-train in this process, as the ``fairseq-train`` console script does, with one
change: once fairseq's ``Trainer`` holds the freshly initialized model, each of its
parameters is moved ``ULPS`` floats up (:func:`fairseq_vasso.hooks.nudge_initial_weights`,
beside every other patch of fairseq). ``ULPS`` 0 is stock fairseq-train
(tests/scripts/test_demo.py checks it bit for bit).

``FAIRSEQ_TRAIN_ARGS`` must name the ``--user-dir``. The demo runs this file by path, and
nothing of ``fairseq_vasso`` is imported here before fairseq imports that user-dir itself
(``fairseq.utils.import_user_module``, as fairseq-train does): so the run trains with the
user-dir's fairseq_vasso whatever else the path holds, and fairseq, which refuses a
``--user-dir`` whose module name is already imported from another folder, accepts it.
"""

import argparse
import sys

USAGE = "usage: python scripts/translation/nudged_train.py ULPS -- FAIRSEQ_TRAIN_ARGS... (with --user-dir)"


def user_dir_of(train_args):
    """The value of ``--user-dir`` in fairseq-train's arguments, or None."""
    for i, arg in enumerate(train_args):
        if arg == "--user-dir" and i + 1 < len(train_args):
            return train_args[i + 1]
        if arg.startswith("--user-dir="):
            return arg.split("=", 1)[1]
    return None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(USAGE)
    first, train_args = argv[0], argv[2:]
    try:
        ulps = int(first)
        if ulps < 0:
            raise ValueError
    except ValueError:
        raise SystemExit("nudged_train: ULPS must be an integer >= 0, got %r" % first)
    user_dir = user_dir_of(train_args)
    if user_dir is None:
        raise SystemExit("nudged_train: FAIRSEQ_TRAIN_ARGS must name the --user-dir (" + USAGE + ")")
    # fairseq_cli.train before anything of fairseq, as the fairseq-train script imports it: it
    # sets up the logging (format, level) on import, which is a no-op once anything has logged
    # (importing fairseq does), and the demo reads the epochs' stats in fairseq's format
    from fairseq_cli import train as train_cli  # isort: skip

    from fairseq import utils

    utils.import_user_module(argparse.Namespace(user_dir=user_dir))  # the user-dir's fairseq_vasso
    from fairseq_vasso import hooks

    hooks.nudge_initial_weights(ulps)
    sys.argv = ["fairseq-train", *train_args]
    train_cli.cli_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
