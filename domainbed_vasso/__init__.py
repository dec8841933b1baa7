"""SAM, GSAM and VASSO for an unmodified DomainBed.

    python -m domainbed_vasso.train --data_dir ./data --dataset PACS --algorithm VASSO \\
        --test_envs 0 --output_dir out/ --hparams '{"rho": 0.05, "theta": 0.4}'
    python -m domainbed_vasso.sweep launch ...   # DomainBed's sweep flags, children see VASSO

or, in Python::

    import domainbed_vasso
    domainbed_vasso.register()          # finds DomainBed (PYTHONPATH or DOMAINBED_ROOT)
    from domainbed import algorithms
    algorithms.get_algorithm_class("VASSO")

See docs/domainbed.md.
"""

from ._locate import (DomainBedNotFound, ENV_ROOT, ENV_WEIGHTS, ENV_WORKERS, TESTED_COMMIT,
                      domainbed_root)

__all__ = ["register", "DomainBedNotFound", "ALGORITHMS", "ENV_ROOT", "ENV_WORKERS",
           "ENV_WEIGHTS", "TESTED_COMMIT", "domainbed_root"]

ALGORITHMS = ("SAM", "GSAM", "VASSO")


def register(*, apply_environment=True):
    """Make ``SAM``, ``GSAM`` and ``VASSO`` known to DomainBed in this process.

    * ``domainbed.algorithms``: the classes (so ``get_algorithm_class`` finds them)
      and their names appended to ``ALGORITHMS`` (collect_results' row order);
    * ``domainbed.hparams_registry``: their hparams (ERM's, plus the knobs of
      :mod:`domainbed_vasso.hparams`), for ``default_hparams`` and ``random_hparams``;
    * ``domainbed.datasets``: ``RotatedDigits`` (no download), with registry entries for
      every algorithm; not in ``DATASETS``, so default sweeps and DomainBed's own loops
      over datasets stay DomainBed's (see :mod:`domainbed_vasso.digits_dataset`);
    * with ``apply_environment``: ``DOMAINBED_VASSO_NUM_WORKERS`` (loader workers) and
      ``DOMAINBED_VASSO_RESNET_WEIGHTS`` (offline ResNet weights), when set.

    Idempotent. Raises :class:`DomainBedNotFound` (with the fix) without DomainBed.
    Returns the DomainBed root directory.
    """
    from . import _locate

    algorithms_mod, registry, datasets = _locate.import_domainbed()
    from . import algorithms as ours
    from . import digits_dataset  # RotatedDigits (scikit-learn's digits; docs/domainbed.md)

    for name in ALGORITHMS:
        cls = getattr(ours, name)
        existing = vars(algorithms_mod).get(name)
        if existing is not None and existing is not cls and not getattr(existing, "_domainbed_vasso", False):
            import warnings
            warnings.warn(f"domainbed.algorithms already defines {name}; domainbed_vasso's {name} "
                          "replaces it in this process", RuntimeWarning, stacklevel=2)
        cls._domainbed_vasso = True
        setattr(algorithms_mod, name, cls)
        if name not in algorithms_mod.ALGORITHMS:
            algorithms_mod.ALGORITHMS.append(name)

    _wrap_registry(registry)
    digits_dataset.register(datasets)
    from .slurm import register_launcher  # --command_launcher slurm (submitit)
    register_launcher()

    if apply_environment:
        _locate.apply_num_workers(datasets)
        _locate.apply_resnet_weights()
    return _locate.domainbed_root()


def register_hparams():
    """Only the hparams of ``SAM``, ``GSAM`` and ``VASSO`` (and ``RotatedDigits``') in
    ``domainbed.hparams_registry``, without importing DomainBed's algorithms and datasets
    (torchvision and wilds: seconds): what the entry points check an ``--hparams`` of
    theirs against, so that a bad one is refused at once. :func:`register` does this too.
    Idempotent. Raises :class:`DomainBedNotFound` as :func:`register` does; returns the
    DomainBed root directory."""
    from . import _locate

    (registry,) = _locate.import_domainbed(("hparams_registry",))
    _wrap_registry(registry)
    return _locate.domainbed_root()


def _wrap_registry(registry):
    """``registry._hparams`` answering for SAM, GSAM and VASSO, and for ``RotatedDigits``."""
    from domainbed.lib import misc

    from . import digits_dataset
    from . import hparams as hp

    if not getattr(registry._hparams, "_domainbed_vasso_wrapped", False):
        original = registry._hparams

        def _stock(algorithm, dataset, random_seed):
            if dataset == digits_dataset.NAME:  # small images, MLP featurizer
                return digits_dataset.registry_hparams(original, algorithm, random_seed, misc.seed_hash)
            return original(algorithm, dataset, random_seed)

        def _hparams(algorithm, dataset, random_seed):
            if algorithm not in hp.SPECS:
                return _stock(algorithm, dataset, random_seed)
            # ERM's entries, drawn per name, hence equal to ERM's for this seed.
            out = _stock("ERM", dataset, random_seed)
            own = hp.own_hparams(algorithm, random_seed, misc.seed_hash)
            clash = sorted(set(out) & set(own))
            if clash:
                raise RuntimeError(f"DomainBed's ERM hparams already define {clash}: "
                                   "this DomainBed version is not supported by domainbed_vasso")
            out.update(own)
            return out

        _hparams._domainbed_vasso_wrapped = True
        _hparams._domainbed_vasso_original = original
        _hparams.__doc__ = original.__doc__
        registry._hparams = _hparams
