"""``python -m domainbed_vasso.sweep``: DomainBed's own ``domainbed.scripts.sweep``,
unmodified and with exactly its flags, whose children run
``<this interpreter> -m domainbed_vasso.train`` instead of
``python -m domainbed.scripts.train`` (so they know SAM, GSAM and VASSO).

    python -m domainbed_vasso.sweep launch --data_dir ./data --output_dir sweep/ \\
        --datasets PACS VLCS OfficeHome TerraIncognita \\
        --algorithms ERM SAM GSAM VASSO --command_launcher multi_gpu

    python -m domainbed_vasso.sweep launch ... --command_launcher slurm   # Slurm job array
    python -m domainbed_vasso.sweep status --output_dir sweep/           # its jobs' states

``--command_launcher slurm`` and ``status`` are :mod:`domainbed_vasso.slurm`; with it,
``delete_incomplete`` keeps the folders of jobs Slurm still queues or runs.
``--hparams`` keys that some swept algorithm's registry does not define are refused
before any job is made, unless ``--allow-unknown-hparams`` is given (then the children
get it too); so are ``--algorithms`` and ``--datasets`` that DomainBed does not define.

How: stock DomainBed builds each job's command as the string
``python -m domainbed.scripts.train --...`` inside ``Job.__init__`` of the
``__main__`` module, then hands the list to a launcher of
``domainbed.command_launchers.REGISTRY``. This wrapper wraps every registered
launcher so that it rewrites that prefix (and nothing else) before launching; the
children inherit a PYTHONPATH that finds this package and DomainBed, and the
``DOMAINBED_VASSO_*`` variables.
"""

import contextlib
import os
import shlex
import sys

from . import _locate
from . import slurm as _slurm
from .download import missing_dataset

STOCK_PREFIX = "python -m domainbed.scripts.train"

_FLAGS = {
    "--datasets": dict(nargs="+", type=str, default=None),
    "--algorithms": dict(nargs="+", type=str, default=None),
    "--hparams": dict(type=str, default=None),
    "--output_dir": dict(type=str, default=None),
    "--data_dir": dict(type=str, default=None),
    "--command_launcher": dict(type=str, default=None),
}


def child_prefix(python=None, flags=()):
    """The command prefix of the sweep's children (``flags``: our own train flags)."""
    return " ".join([f"{shlex.quote(python or sys.executable)} -m domainbed_vasso.train", *flags])


def rewrite_command(command, python=None, flags=()):
    """``python -m domainbed.scripts.train ARGS`` -> ``<python> -m domainbed_vasso.train [FLAGS] ARGS``."""
    if not command.startswith(STOCK_PREFIX + " ") and command != STOCK_PREFIX:
        raise RuntimeError(
            f"domainbed_vasso.sweep: this DomainBed's sweep builds commands that do not start with "
            f"{STOCK_PREFIX!r} (got {command[:80]!r}); it is not supported, see docs/domainbed.md")
    return child_prefix(python, flags) + command[len(STOCK_PREFIX):]


def _rewriting(launcher, flags=()):
    launcher = getattr(launcher, "_domainbed_vasso_original", launcher)

    def launch(commands):
        return launcher([rewrite_command(c, flags=flags) for c in commands])

    launch._domainbed_vasso_original = launcher
    launch.__name__ = getattr(launcher, "__name__", "launcher")
    launch.__doc__ = getattr(launcher, "__doc__", None)
    return launch


def patch_launchers(flags=()):
    """Wrap every launcher in DomainBed's ``command_launchers.REGISTRY`` (again, with these
    ``flags``, when already wrapped)."""
    from domainbed import command_launchers
    for name, launcher in list(command_launchers.REGISTRY.items()):
        command_launchers.REGISTRY[name] = _rewriting(launcher, tuple(flags))
    return command_launchers.REGISTRY


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["status"]:
        raise SystemExit(_slurm.status_main(argv[1:]))
    _locate.exit_if_requirement_missing("domainbed_vasso.sweep")
    # imported here, after the check: they need numpy and torch
    from . import _cli
    from . import hparams as _hp
    _cli.register_or_exit()
    os.environ["PYTHONPATH"] = _locate.child_pythonpath()
    argv, allow_unknown = _cli.take_flag(argv, _hp.ALLOW_UNKNOWN)
    patch_launchers([_hp.ALLOW_UNKNOWN] if allow_unknown else [])  # the children get it too
    guard = contextlib.nullcontext()
    if not any(a in ("-h", "--help") for a in argv):
        args = _cli.known_args(argv, _FLAGS)
        if args is not None:
            from domainbed import algorithms, datasets
            for algorithm in args.algorithms or ():
                _cli.check_algorithm("--algorithms", algorithm)
            for dataset in args.datasets or ():
                _cli.check_dataset("--datasets", dataset)
            try:
                overrides = _hp.parse_overrides(args.hparams)
                for algorithm in (args.algorithms or algorithms.ALGORITHMS) if overrides else ():
                    for dataset in args.datasets or datasets.DATASETS:  # DomainBed's defaults
                        _cli.check_hparams(algorithm, dataset, overrides, allow_unknown=allow_unknown)
            except _hp.HParamError as exc:
                _cli.fail(str(exc))
        command = next((a for a in argv if a in ("launch", "delete_incomplete")), None)
        if args is not None and command == "launch" and args.command_launcher != "dummy":  # dummy runs nothing
            for dataset in args.datasets or datasets.DATASETS:
                missing = missing_dataset(dataset, args.data_dir)
                if missing:
                    _cli.fail(missing)
        try:
            if args is not None and command == "launch" and args.command_launcher == "slurm":
                _slurm.preflight()  # before DomainBed makes the job folders
            elif args is not None and command == "delete_incomplete" and args.output_dir:
                # DomainBed takes a queued or running job for an incomplete one
                guard = _slurm.keep_active_folders(args.output_dir)
        except _slurm.SlurmLauncherError as exc:
            _cli.fail(str(exc))
    try:
        with guard:
            _cli.run_domainbed_script("domainbed.scripts.sweep", "domainbed_vasso.sweep", argv)
    except _slurm.SlurmLauncherError as exc:
        _cli.fail(str(exc))


if __name__ == "__main__":
    main()
