"""``python -m domainbed_vasso.train``: DomainBed's own ``domainbed.scripts.train``,
unmodified and with exactly its flags, after :func:`domainbed_vasso.register`.

    python -m domainbed_vasso.train --data_dir ./data --dataset PACS --algorithm VASSO \\
        --test_envs 0 --output_dir out/ --hparams '{"rho": 0.05, "theta": 0.4}'

Environment: ``DOMAINBED_ROOT`` (where DomainBed is, unless on PYTHONPATH),
``DOMAINBED_VASSO_NUM_WORKERS`` (data loader workers per environment; DomainBed's
default is 8), ``DOMAINBED_VASSO_RESNET_WEIGHTS`` (offline ResNet weights: a .pth
path, or ``none``). The hparams of SAM, GSAM and VASSO are checked first, against
DomainBed's registry alone (before its models and datasets are imported); a bad one
stops the run with a message naming it. So does an ``--algorithm`` or ``--dataset``
DomainBed does not define (it would find out after loading the data), or an ``--hparams``
key the algorithm's registry does not define (DomainBed would ignore it: a typo would
train with the default), unless ``--allow-unknown-hparams`` is given (our one flag;
DomainBed's old behaviour, with a warning). An image dataset missing from ``--data_dir``
stops it with the download command (:mod:`domainbed_vasso.download`).
"""

import sys

from . import _locate
from .download import missing_dataset

_FLAGS = {
    "--data_dir": dict(type=str, default=None),
    "--dataset": dict(type=str, default="RotatedMNIST"),
    "--algorithm": dict(type=str, default="ERM"),
    "--hparams": dict(type=str, default=None),
    "--hparams_seed": dict(type=int, default=0),
    "--trial_seed": dict(type=int, default=0),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    _locate.exit_if_requirement_missing("domainbed_vasso.train")
    # imported here, after the check: they need numpy and torch
    from . import _cli
    from . import hparams as _hp
    argv, allow_unknown = _cli.take_flag(argv, _hp.ALLOW_UNKNOWN)
    args = None if any(a in ("-h", "--help") for a in argv) else _cli.known_args(argv, _FLAGS)

    def check():
        try:
            overrides = _hp.parse_overrides(args.hparams)
            _cli.check_hparams(args.algorithm, args.dataset, overrides, args.hparams_seed, args.trial_seed,
                               allow_unknown)
        except _hp.HParamError as exc:
            _cli.fail(str(exc))

    ours = args is not None and args.algorithm in _hp.SPECS
    if ours:  # checked against the registry alone: refused before DomainBed's models and datasets load
        _cli.register_or_exit(hparams_only=True)
        check()
    _cli.register_or_exit()
    if args is not None:
        _cli.check_algorithm("--algorithm", args.algorithm)
        _cli.check_dataset("--dataset", args.dataset)
        if not ours:
            check()
        missing = missing_dataset(args.dataset, args.data_dir)
        if missing:
            _cli.fail(missing)
    _cli.run_domainbed_script("domainbed.scripts.train", "domainbed_vasso.train", argv)


if __name__ == "__main__":
    main()
