"""Shared plumbing of the ``train`` and ``sweep`` entry points."""

import argparse
import runpy
import sys

from . import hparams as _hp
from ._locate import DomainBedNotFound


def fail(message, code=2):
    print(f"domainbed_vasso: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def register_or_exit():
    from . import register
    try:
        return register()
    except DomainBedNotFound as exc:
        fail(str(exc))
    except (ValueError, FileNotFoundError) as exc:  # bad environment variable
        fail(str(exc))


def known_args(argv, spec):
    """Parse the flags named in ``spec`` ({flag: kwargs}) out of ``argv``, ignoring the
    rest; None when they do not parse (DomainBed's own parser will say why)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, kwargs in spec.items():
        parser.add_argument(flag, **kwargs)
    try:
        args, _ = parser.parse_known_args(argv)
    except SystemExit:
        return None
    return args


def check_hparams(algorithm, dataset, overrides, hparams_seed=0, trial_seed=0):
    """Validate the hparams DomainBed's train script will build for one of our algorithms."""
    if algorithm not in _hp.SPECS:
        return None
    from domainbed import hparams_registry
    from domainbed.lib import misc
    if hparams_seed == 0:
        hparams = hparams_registry.default_hparams(algorithm, dataset)
    else:
        hparams = hparams_registry.random_hparams(algorithm, dataset,
                                                  misc.seed_hash(hparams_seed, trial_seed))
    hparams.update(overrides)
    _hp.warn_unused(algorithm, overrides)
    return _hp.validate(algorithm, hparams)


def _tolerant_expand_help(expand):
    """argparse's help expansion, falling back to the raw text where it holds a bare
    ``%`` (DomainBed b93c22a's ``--uda_holdout_fraction`` does, which makes its own
    ``-h`` crash)."""
    def expand_help(self, action):
        try:
            return expand(self, action)
        except (ValueError, TypeError, KeyError):
            return action.help
    return expand_help


def run_domainbed_script(module, prog, argv):
    """Run DomainBed's ``module`` as ``__main__`` in this process with ``argv``."""
    sys.argv = [prog] + list(argv)
    stock_expand = argparse.HelpFormatter._expand_help
    argparse.HelpFormatter._expand_help = _tolerant_expand_help(stock_expand)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except _hp.HParamError as exc:
        fail(str(exc))
    finally:
        argparse.HelpFormatter._expand_help = stock_expand
