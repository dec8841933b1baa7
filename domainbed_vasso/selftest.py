"""``vasso-selftest``'s DomainBed check: one update of DomainBed's own ERM and of
``VASSO`` as DomainBed builds it (``get_algorithm_class``, ``default_hparams``), on the
device, from the same seed and minibatches.  With ``rho = 0`` VASSO's update is ERM's bit
for bit; with the default rho it takes a two-pass step with finite weights."""

from __future__ import annotations

import os
import subprocess
from typing import Optional

from plugins.lab.selftest.checks import CheckFailed, Skipped

from . import DomainBedNotFound, TESTED_COMMIT, domainbed_root

DATASET = "RotatedDigits"  # registered by domainbed_vasso: 8x8 digits flattened, DomainBed's MLP featurizer
INPUT_SHAPE, CLASSES, ENVIRONMENTS = (64,), 10, 3


def domainbed_missing() -> Optional[str]:
    """Why the check cannot run, or None."""
    try:
        domainbed_root()
    except DomainBedNotFound as exc:
        return "DomainBed not found: " + str(exc).strip().splitlines()[0]
    return None


def domainbed_commit(root: str) -> str:
    """The checkout's commit, or what is known without git metadata."""
    if os.path.exists(os.path.join(root, ".git")):
        try:
            out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
            if out.returncode == 0:
                return out.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"unknown (no git metadata; tested: {TESTED_COMMIT[:7]})"


def _state(algorithm):
    return {k: v.detach().cpu().clone() for k, v in algorithm.state_dict().items()}


def check_domainbed(device: str):
    why = domainbed_missing()
    if why:
        raise Skipped(why)
    import torch

    from . import register

    root = register()
    from domainbed import algorithms, hparams_registry

    g = torch.Generator().manual_seed(1)
    minibatches = [(torch.randn(8, *INPUT_SHAPE, generator=g).to(device),
                    torch.randint(0, CLASSES, (8,), generator=g).to(device)) for _ in range(ENVIRONMENTS)]

    def one_update(name, **overrides):
        hparams = hparams_registry.default_hparams(name, DATASET)
        hparams.update(overrides)
        torch.manual_seed(0)
        algorithm = algorithms.get_algorithm_class(name)(INPUT_SHAPE, CLASSES, ENVIRONMENTS, hparams).to(device)
        before = _state(algorithm)
        torch.manual_seed(2)
        out = algorithm.update(minibatches)
        return before, _state(algorithm), out, hparams

    erm_before, erm, _, _ = one_update("ERM")
    zero_before, zero, zero_out, _ = one_update("VASSO", rho=0.0)
    _, vasso, out, hparams = one_update("VASSO")
    details = {"domainbed_root": root, "commit": domainbed_commit(root), "dataset": DATASET,
               "vasso_hparams": {k: v for k, v in hparams.items() if isinstance(v, (int, float, bool, str))}}
    problems = []
    if erm_before.keys() != zero_before.keys() or not all(torch.equal(erm_before[k], zero_before[k])
                                                           for k in erm_before):
        problems.append("VASSO's initial weights are not ERM's from the same seed")
    differ = [k for k in erm if k not in zero or not torch.equal(erm[k], zero[k])]
    moved = not all(torch.equal(erm[k], erm_before[k]) for k in erm)
    finite = all(torch.isfinite(v).all() for v in vasso.values() if v.is_floating_point())
    changed = any(not torch.equal(vasso[k], erm[k]) for k in erm)
    details.update(rho0_tensors_differing_from_erm=differ, rho=hparams.get("rho"), update=out)
    if differ:
        problems.append(f"rho=0: {len(differ)} tensors differ from ERM's update ({', '.join(differ[:3])})")
    if not moved:
        problems.append("ERM's update did not move its weights")
    if not (finite and changed and out.get("two_pass") == 1.0):
        problems.append(f"rho={hparams.get('rho')}: finite weights {finite}, differ from ERM {changed}, "
                        f"two_pass {out.get('two_pass')}")
    if problems:
        raise CheckFailed("; ".join(problems), details)
    figure = (f"one update of DomainBed's VASSO ({DATASET}): rho=0 equals ERM bit for bit ({len(erm)} tensors); "
              f"rho={hparams.get('rho')}: two-pass step, finite, loss {out['loss']:.3f}")
    return figure, details
