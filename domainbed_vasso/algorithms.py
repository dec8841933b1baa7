"""SAM, GSAM and VASSO as DomainBed algorithms (DomainBed's ``algorithms.py`` style).

Each is ERM (same featurizer, classifier and Adam, built in the same order from the
same hparams, so the same seed gives the same initial weights) whose Adam steps
through the sharpness-aware wrapper of :mod:`plugins`:

1. forward/backward on the concatenated minibatches: ``g_t``;
2. ``perturb()``: move to ``x_t + eps_t`` (unless the eSAM/eVASSO coin skips);
3. second forward/backward on the same batch inside the core's ``second_pass()``:
   the same RNG state (the same dropout masks), BatchNorm running statistics
   frozen, the step abandoned on an exception: ``h_t``;
4. ``descend()``: back to ``x_t``, Adam steps with ``h_t`` (GSAM-corrected).

With ``rho = 0`` each reproduces ERM step for step. The module imports without
DomainBed: pass ``featurizer=`` and ``classifier=`` modules to use the algorithms on
any torch network (DomainBed itself is needed only to build its own networks).

``update()`` returns, as floats, ``loss`` (at ``x_t``, as ERM reports it) and
``two_pass`` (1.0 or 0.0) and ``rho`` on every step, and on two-pass steps
``loss_perturbed`` (at ``x_t + eps_t``), ``loss_gap`` (their difference, the
perturbed-loss gap), ``sharpness`` (the paper's estimated sharpness
``rho * ||v_t||``), ``ascent_norm`` (``||eps_t||``) and, from the second
two-pass step on, ``stability`` (``||eps_t - eps_{t-1}||``, the paper's Fig. 4).
DomainBed averages each key over the steps that report it, between checkpoints,
into ``results.jsonl``. ``nonfinite`` is 1.0 on a step the core skipped for a
non-finite gradient.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from plugins import SAM as _SAMOptimizer
from plugins import VASSO as _VASSOOptimizer
from plugins import rng_state

from . import hparams as _hp

__all__ = ["SharpnessAwareERM", "SAM", "GSAM", "VASSO", "ALGORITHMS"]

ALGORITHMS = list(_hp.ALGORITHMS)


class SharpnessAwareERM(nn.Module):
    """ERM whose Adam takes sharpness-aware steps (base of SAM, GSAM, VASSO).

    Args follow DomainBed's ``Algorithm``: ``(input_shape, num_classes, num_domains,
    hparams)``. ``featurizer`` and ``classifier`` (torch modules) replace DomainBed's
    ``networks.Featurizer`` and ``networks.Classifier``; a featurizer given without a
    classifier needs DomainBed's ``n_outputs`` attribute. Invalid knobs raise
    :class:`domainbed_vasso.hparams.HParamError` here, before any training.
    """

    #: the plugins optimizer class
    CORE = None
    #: hparams passed to it (their names in :mod:`domainbed_vasso.hparams`)
    KNOBS = ()

    def __init__(self, input_shape, num_classes, num_domains, hparams, *,
                 featurizer=None, classifier=None):
        super().__init__()
        self.hparams = hparams
        knobs = _hp.validate(self._spec_name(), hparams)
        if featurizer is None or classifier is None:
            from domainbed import networks
            if featurizer is None:
                featurizer = networks.Featurizer(input_shape, self.hparams)
            if classifier is None:
                classifier = networks.Classifier(featurizer.n_outputs, num_classes,
                                                 self.hparams['nonlinear_classifier'])
        self.featurizer = featurizer
        self.classifier = classifier
        self.network = nn.Sequential(self.featurizer, self.classifier)
        kwargs = {k: knobs[k] for k in self.KNOBS}
        # The coin of eSAM/eVASSO is a function of (seed, step): seed it from the
        # run's --seed (DomainBed calls torch.manual_seed(args.seed) before building
        # the algorithm) without drawing from the global generator, so rho = 0
        # leaves ERM's random stream untouched.
        self.optimizer = self.CORE(
            list(self.network.named_parameters()),
            torch.optim.Adam,
            seed=int(torch.initial_seed() % (2 ** 63)),
            lr=self.hparams["lr"],
            weight_decay=self.hparams['weight_decay'],
            **kwargs)

    @classmethod
    def _spec_name(cls):
        for base in cls.__mro__:
            if base.__name__ in _hp.SPECS:
                return base.__name__
        raise TypeError(f"{cls.__name__} derives from none of {', '.join(_hp.SPECS)}")

    def _loss(self, all_x, all_y):
        return F.cross_entropy(self.predict(all_x), all_y)

    def update(self, minibatches, unlabeled=None):
        all_x = torch.cat([x for x, y in minibatches])
        all_y = torch.cat([y for x, y in minibatches])
        rng = rng_state()  # CPU, and CUDA's once initialized: the second pass replays it

        self.optimizer.zero_grad()
        loss = self._loss(all_x, all_y)
        loss.backward()
        out = {"loss": loss.item()}

        second = None
        if self.optimizer.perturb():
            self.optimizer.zero_grad()
            with self.optimizer.second_pass(self.network, rng):
                second = self._loss(all_x, all_y)
                second.backward()
        self.optimizer.descend()

        diag = self.optimizer.diagnostics
        out["rho"] = float(diag["rho"])
        out["two_pass"] = float(diag["two_pass"])
        if diag.get("nonfinite", 0.0):
            out["nonfinite"] = 1.0
        if second is not None:
            out["loss_perturbed"] = second.item()
            out["loss_gap"] = out["loss_perturbed"] - out["loss"]
            for key in ("sharpness", "ascent_norm", "stability"):
                value = float(diag.get(key, math.nan))
                if math.isfinite(value):
                    out[key] = value
        return out

    def predict(self, x):
        return self.network(x)


class SAM(SharpnessAwareERM):
    """SAM (Foret et al., 2021) over ERM's Adam; ``p < 1`` gives eSAM, ``adaptive`` ASAM."""
    CORE = _SAMOptimizer
    KNOBS = ("rho", "p", "adaptive", "eta")


class GSAM(SharpnessAwareERM):
    """GSAM (Zhuang et al., 2022): SAM's ascent, descent ``h - gsam_alpha * g_perp``;
    constant rho. (GSAM's rho schedule follows the learning rate, and DomainBed's is
    constant: the schedule would hold rho at rho_max throughout, so it is not exposed.)"""
    CORE = _SAMOptimizer
    KNOBS = ("rho", "gsam_alpha", "p", "adaptive", "eta")


class VASSO(SharpnessAwareERM):
    """VASSO (Li and Giannakis, NeurIPS 2023): the ascent follows the EMA
    ``d_t = (1 - theta) d_{t-1} + theta g_t`` (``d_0 = g_0``). ``p < 1`` gives eVASSO,
    ``gsam_alpha > 0`` VASSO+GSAM ("V+G", this project's reading), ``adaptive`` the
    ASAM geometry."""
    CORE = _VASSOOptimizer
    KNOBS = ("rho", "theta", "gsam_alpha", "p", "adaptive", "eta")
