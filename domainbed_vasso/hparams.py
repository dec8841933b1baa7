"""Hyper-parameters of SAM, GSAM and VASSO in DomainBed's registry.

Every algorithm here is ERM plus a few knobs. ``hparams(algorithm, dataset, seed)``
returns ERM's entries for the same ``(dataset, seed)`` (so a sweep's ``hparams_seed``
gives ERM and VASSO the same learning rate, batch size, weight decay, dropout:
paired comparisons) plus the knobs below, each drawn from its own
``RandomState(seed_hash(seed, name))`` exactly as DomainBed draws its own.

=============  ==========  ===========================================  ================
name           default     random search                                used by
=============  ==========  ===========================================  ================
rho            0.05        {0.01, 0.02, 0.05, 0.1}                      SAM, GSAM, VASSO
theta          0.4         {0.2, 0.4, 0.9} (the paper's grid)           VASSO
gsam_alpha     0.1 / 0     GSAM: {0.01, 0.05, 0.1, 0.2, 0.3}; VASSO: 0   GSAM, VASSO (V+G)
p              1.0         1.0 (eSAM/eVASSO: set it, e.g. 0.5)          SAM, GSAM, VASSO
adaptive       False       False (ASAM geometry: set it)                SAM, GSAM, VASSO
eta            0.01        0.01 (ASAM's offset)                         SAM, GSAM, VASSO
=============  ==========  ===========================================  ================

rho is constant. GSAM's rho schedule (the core's ``rho_min``, rho proportional to the
learning rate) is not an hparam: DomainBed's learning rate is constant, so the schedule
would keep rho at its maximum ``rho`` for the whole run, the same as a constant rho.

The rho grid is the one SAGM (Wang et al., CVPR 2023, whose Adam/SAM/GSAM DomainBed
numbers the paper quotes) searches; the GSAM alpha grid is this project's choice.
"""

import difflib
import json

import numpy as np

from plugins.validation import Range, check

ALGORITHMS = ("SAM", "GSAM", "VASSO")


def _choice(values):
    return lambda r: type(values[0])(r.choice(values))


def _const(value):
    return lambda r: value


# Each row: (hparam, default, random_fn(RandomState), range). The hparam names are the
# core's argument names, so plugins.validation checks them; ``range`` narrows the core's
# where DomainBed allows less (None: the core's): p = 0 would never take a second
# pass, which is ERM (use --algorithm ERM).
_RHO = ("rho", 0.05, _choice([0.01, 0.02, 0.05, 0.1]), None)
_P = ("p", 1.0, _const(1.0), Range(0.0, 1.0, "(]"))
_ADAPTIVE = ("adaptive", False, _const(False), None)
_ETA = ("eta", 0.01, _const(0.01), None)

#: name -> [(hparam, default, random_fn(RandomState), range or None)]
SPECS = {
    "SAM": [_RHO, _P, _ADAPTIVE, _ETA],
    "GSAM": [_RHO, ("gsam_alpha", 0.1, _choice([0.01, 0.05, 0.1, 0.2, 0.3]), None), _P, _ADAPTIVE, _ETA],
    "VASSO": [_RHO, ("theta", 0.4, _choice([0.2, 0.4, 0.9]), None),
              ("gsam_alpha", 0.0, _const(0.0), None), _P, _ADAPTIVE, _ETA],
}

def own_hparams(algorithm, random_seed, seed_hash):
    """``{name: (default, random)}`` of the knobs of ``algorithm`` for ``random_seed``."""
    out = {}
    for name, default, random_fn, _range in SPECS[algorithm]:
        state = np.random.RandomState(seed_hash(random_seed, name))
        out[name] = (default, random_fn(state))
    return out


class HParamError(ValueError):
    """An out-of-range or ill-typed hparam of SAM, GSAM or VASSO."""


def validate(algorithm, hparams):
    """Raise :class:`HParamError` naming every bad knob of ``algorithm`` in ``hparams``.

    Missing knobs are an error too (DomainBed's registry always provides them).
    Returns the knobs as plain Python values (floats and bools).
    """
    if algorithm not in SPECS:
        raise HParamError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
    problems, values = [], {}
    for name, _default, _random_fn, within in SPECS[algorithm]:
        if name not in hparams:
            problems.append(f"{name} is missing")
            continue
        try:
            values[name] = check(name, hparams[name], within=within, words=("true", "false"))
        except ValueError as exc:
            problems.append(str(exc))
    for name in ("lr", "weight_decay"):  # ERM's, passed to the base Adam
        if hparams.get(name) is not None:
            try:
                check(name, hparams[name])
            except ValueError as exc:
                problems.append(str(exc))
    if problems:
        raise HParamError(f"{algorithm}: invalid hparams: " + "; ".join(problems)
                          + " (set them with --hparams '{\"name\": value}')")
    return values


#: The flag of ``domainbed_vasso.train`` and ``.sweep`` that lets unknown keys through.
ALLOW_UNKNOWN = "--allow-unknown-hparams"


def unknown_hparams(algorithm, dataset, overrides, defined):
    """One line naming each ``--hparams`` key that ``defined`` (the registry's hparams of
    ``algorithm`` on ``dataset``) lacks, with the closest valid key; None when all are known.

    DomainBed copies any key into the hparams and reads only those it knows, so a typo
    (``theat``) would train silently with the default.
    """
    unknown = [key for key in overrides if key not in defined]
    if not unknown:
        return None
    named = []
    for key in unknown:
        owners = [name for name, specs in SPECS.items() if key in {spec[0] for spec in specs}]
        close = difflib.get_close_matches(key, sorted(defined), n=1)
        if owners:  # another algorithm's knob, not a typo
            named.append(f"{key!r} (an hparam of {', '.join(owners)} only)")
        else:
            named.append(f"{key!r}" + (f" (closest valid: {close[0]!r})" if close else ""))
    return (f"--hparams: {', '.join(named)} {'is not an hparam' if len(unknown) == 1 else 'are not hparams'} "
            f"of {algorithm} on {dataset} (DomainBed would ignore {'it' if len(unknown) == 1 else 'them'}; "
            f"{ALLOW_UNKNOWN} lets it)")


def parse_overrides(text):
    """The ``--hparams`` JSON of DomainBed's train script, as a dict (``{}`` for None)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HParamError(f"--hparams is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HParamError(f"--hparams must be a JSON object, got {text!r}")
    return value
