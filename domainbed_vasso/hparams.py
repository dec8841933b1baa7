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

The rho grid is the one SAGM (Wang et al., CVPR 2023, whose Adam/SAM/GSAM DomainBed
numbers the paper quotes) searches; the GSAM alpha grid is this project's choice.
"""

import json
import math
import numbers
import warnings

import numpy as np

ALGORITHMS = ("SAM", "GSAM", "VASSO")


def _choice(values):
    return lambda r: type(values[0])(r.choice(values))


def _const(value):
    return lambda r: value


def _real(low, high, low_open=False, high_open=False):
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"must be a real number in {interval}, got {value!r} ({type(value).__name__})"
        v = float(value)
        if (math.isnan(v) or v < low or v > high or (low_open and v == low)
                or (high_open and v == high)):
            return f"must be in {interval}, got {value!r}"
        return None

    check.interval = interval
    return check


def _boolean(name, value):
    if isinstance(value, (bool, np.bool_)):
        return None
    return f"must be true or false, got {value!r} ({type(value).__name__})"


_RHO = ("rho", 0.05, _choice([0.01, 0.02, 0.05, 0.1]), _real(0.0, math.inf, high_open=True))
_P = ("p", 1.0, _const(1.0), _real(0.0, 1.0, low_open=True))
_ADAPTIVE = ("adaptive", False, _const(False), _boolean)
_ETA = ("eta", 0.01, _const(0.01), _real(0.0, math.inf, high_open=True))
_ALPHA_CHECK = _real(0.0, math.inf, high_open=True)

#: name -> [(hparam, default, random_fn(RandomState), check(name, value) -> error or None)]
SPECS = {
    "SAM": [_RHO, _P, _ADAPTIVE, _ETA],
    "GSAM": [_RHO, ("gsam_alpha", 0.1, _choice([0.01, 0.05, 0.1, 0.2, 0.3]), _ALPHA_CHECK),
             _P, _ADAPTIVE, _ETA],
    "VASSO": [_RHO, ("theta", 0.4, _choice([0.2, 0.4, 0.9]), _real(0.0, 1.0, low_open=True)),
              ("gsam_alpha", 0.0, _const(0.0), _ALPHA_CHECK), _P, _ADAPTIVE, _ETA],
}

#: Every knob any of the algorithms knows (to tell typos from another algorithm's knob).
KNOWN = sorted({spec[0] for specs in SPECS.values() for spec in specs})


def own_hparams(algorithm, random_seed, seed_hash):
    """``{name: (default, random)}`` of the knobs of ``algorithm`` for ``random_seed``."""
    out = {}
    for name, default, random_fn, _ in SPECS[algorithm]:
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
    for name, _default, _random_fn, check in SPECS[algorithm]:
        if name not in hparams:
            problems.append(f"{name} is missing")
            continue
        value = hparams[name]
        error = check(name, value)
        if error:
            problems.append(f"{name} {error}")
        else:
            values[name] = bool(value) if check is _boolean else float(value)
    for name in ("lr", "weight_decay"):
        value = hparams.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not math.isfinite(float(value)) or float(value) < 0):
            problems.append(f"{name} must be a non-negative real number, got {value!r}")
    if problems:
        raise HParamError(f"{algorithm}: invalid hparams: " + "; ".join(problems)
                          + " (set them with --hparams '{\"name\": value}')")
    return values


def warn_unused(algorithm, overrides):
    """Warn about ``--hparams`` keys that ``algorithm`` ignores but another SA algorithm uses
    (e.g. ``theta`` given to SAM), since DomainBed accepts any key silently."""
    mine = {spec[0] for spec in SPECS.get(algorithm, ())}
    unused = sorted(k for k in overrides if k in KNOWN and k not in mine)
    if unused:
        warnings.warn(f"{algorithm} ignores the hparams {', '.join(unused)} "
                      f"(used by other sharpness-aware algorithms only)", UserWarning, stacklevel=2)
    return unused


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
