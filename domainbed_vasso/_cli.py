"""Shared plumbing of the ``train`` and ``sweep`` entry points."""

import argparse
import difflib
import runpy
import sys

from . import hparams as _hp
from ._locate import DomainBedNotFound


def fail(message, code=2):
    print(f"domainbed_vasso: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def register_or_exit(hparams_only=False):
    """:func:`domainbed_vasso.register` (``hparams_only``: :func:`~domainbed_vasso.register_hparams`),
    or the error, as the entry points give theirs."""
    from . import register, register_hparams
    try:
        return register_hparams() if hparams_only else register()
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


def take_flag(argv, flag):
    """``(argv without flag, whether it was there)``: our own flags, before DomainBed's
    parser (which knows only its own) sees ``argv``."""
    rest = [a for a in argv if a != flag]
    return rest, len(rest) != len(argv)


def check_algorithm(flag, name):
    """Refuse ``name``, the value of ``flag``, unless ``domainbed.algorithms`` defines it (as
    ``get_algorithm_class`` looks it up): DomainBed's train script finds out only after it has
    loaded the data, its sweep after it has launched every job."""
    from domainbed import algorithms
    _check_known(flag, name, algorithms, algorithms.ALGORITHMS)


def check_dataset(flag, name):
    """Refuse ``name``, the value of ``flag``, unless ``domainbed.datasets`` defines it (as the
    train script looks it up), ``RotatedDigits`` among them once registered."""
    from domainbed import datasets

    from .digits_dataset import NAME as DIGITS
    _check_known(flag, name, datasets, datasets.DATASETS + [DIGITS])


def _check_known(flag, name, module, listed):
    if name in vars(module):
        return
    close = difflib.get_close_matches(name, listed, n=1)
    fail(f"{flag}: {name!r}" + (f" (closest valid: {close[0]!r})" if close else "")
         + f" is not one of DomainBed's; expected one of {', '.join(listed)}")


def check_hparams(algorithm, dataset, overrides, hparams_seed=0, trial_seed=0, allow_unknown=False):
    """Check the hparams DomainBed's train script will build, before it builds anything:
    every ``--hparams`` key must be one the registry defines for ``algorithm`` (any
    algorithm; a warning instead with ``allow_unknown``), and the knobs of SAM, GSAM and
    VASSO must be in range. Raises :class:`~domainbed_vasso.hparams.HParamError`. For SAM,
    GSAM and VASSO, :func:`~domainbed_vasso.register_hparams` is all it needs."""
    import warnings

    from domainbed import hparams_registry
    from domainbed.lib import misc
    if algorithm not in _hp.SPECS:
        from domainbed import algorithms
        if algorithm not in algorithms.ALGORITHMS:
            return None  # DomainBed's train script names it
    if hparams_seed == 0:
        hparams = hparams_registry.default_hparams(algorithm, dataset)
    else:
        hparams = hparams_registry.random_hparams(algorithm, dataset,
                                                  misc.seed_hash(hparams_seed, trial_seed))
    unknown = _hp.unknown_hparams(algorithm, dataset, overrides, hparams)
    if unknown and not allow_unknown:
        raise _hp.HParamError(unknown)
    if unknown:
        warnings.warn(unknown, UserWarning, stacklevel=2)
    if algorithm not in _hp.SPECS:
        return None
    hparams.update(overrides)
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
