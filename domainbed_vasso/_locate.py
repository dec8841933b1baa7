"""Find an unmodified DomainBed checkout and adjust the few process-wide knobs
DomainBed has no flag for (loader workers, offline ResNet weights).

DomainBed is not a pip package. :func:`domainbed_root` is the one locator (the entry
points, ``vasso-selftest`` and the tests use it); it takes the first of

1. the checkout named by the environment variable ``DOMAINBED_ROOT`` (the directory that
   contains the ``domainbed/`` package);
2. ``sys.path``: ``PYTHONPATH``, the current directory, or the copy that
   ``scripts/setup_env.sh --with-domainbed`` installs into the environment (a ``.pth`` file);
3. only when this package runs from a source checkout of the project (not an installed
   copy): a DomainBed checkout beside it at :data:`BESIDE_THE_CHECKOUT`, where
   ``scripts/test.sh`` and CI find it.  ``DOMAINBED_VASSO_BESIDE=0`` turns this off (the
   tests' environments that must lack DomainBed).
"""

import importlib
import importlib.util
import os
import sys

ENV_ROOT = "DOMAINBED_ROOT"
ENV_WORKERS = "DOMAINBED_VASSO_NUM_WORKERS"
ENV_WEIGHTS = "DOMAINBED_VASSO_RESNET_WEIGHTS"
ENV_BESIDE = "DOMAINBED_VASSO_BESIDE"

#: Where a source checkout of this project finds DomainBed when neither DOMAINBED_ROOT nor
#: sys.path provides it, relative to the folder that holds the checkout: the one place this
#: package names a path outside its repository, and only for a development checkout (an
#: installed package never looks there). The layout of CI and of scripts/test.sh.
BESIDE_THE_CHECKOUT = os.path.join("shared", "DomainBed")

#: The DomainBed commit this package is tested against (docs/domainbed.md).
TESTED_COMMIT = "b93c22a1cfc3b2428398272c1a116c8de1f4139e"


#: What this package itself imports (its hparams and algorithms), checked by the entry
#: points before anything imports them.
REQUIREMENTS = ("numpy", "torch")


#: How to get DomainBed, in one line: what every test that needs it says when it skips,
#: and what scripts/compat.sh says when it stops (``domainbed_root()``'s error says more).
NOT_IMPORTABLE = (
    f"DomainBed not importable: install it into .venv with `bash scripts/setup_env.sh --with-domainbed` "
    f"(at the tested commit {TESTED_COMMIT[:7]}; `--with-domainbed=/path/to/DomainBed` for a copy you have), "
    f"or set {ENV_ROOT}=/path/to/DomainBed (a checkout at {TESTED_COMMIT[:7]}); a source checkout of this "
    "project also finds ../shared/DomainBed beside it when neither is there")


class DomainBedNotFound(ImportError):
    """DomainBed cannot be imported; the message says how to fix it."""


# import name -> pip name, where they differ
_PIP_NAMES = {"PIL": "pillow", "sklearn": "scikit-learn"}


def _missing_module_fix(name, needed_by, entry="domainbed_vasso.train"):
    """The fix for a module missing from this interpreter: usually the wrong Python
    (the system's instead of the project's environment), not a missing DomainBed."""
    return (f"this Python ({sys.executable}) has no module named {name!r}, which {needed_by} "
            "imports.\nFix: run it with the Python environment where torch and this project are "
            f"installed: in a clone of this project, `.venv/bin/python -m {entry} ...` "
            "(or `source .venv/bin/activate` first); `bash scripts/setup_env.sh` creates .venv with "
            "torch and DomainBed's requirements. "
            f"Or install it into this Python: pip install {_PIP_NAMES.get(name, name)}.")


def missing_requirement(entry="domainbed_vasso.train"):
    """A message naming the first of :data:`REQUIREMENTS` this interpreter lacks and the
    fix, or None when all are there (found without importing them)."""
    for name in REQUIREMENTS:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return _missing_module_fix(name, "domainbed_vasso", entry)
    return None


def exit_if_requirement_missing(entry):
    """Stop the entry point ``entry`` with one message (exit code 2, as for a missing
    DomainBed) when this interpreter lacks :data:`REQUIREMENTS`."""
    message = missing_requirement(entry)
    if message:
        print(f"domainbed_vasso: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _how_to_fix(detail):
    return (
        "domainbed_vasso needs a DomainBed checkout (it is not a pip package). "
        f"{detail}\nFix: in a clone of this project, `bash scripts/setup_env.sh --with-domainbed` "
        f"installs DomainBed at the tested commit ({TESTED_COMMIT[:7]}) into .venv, where it is found "
        "without any variable. Or git clone https://github.com/facebookresearch/DomainBed "
        "/path/to/DomainBed, then either\n"
        f"    export {ENV_ROOT}=/path/to/DomainBed\n"
        "or put /path/to/DomainBed on PYTHONPATH. DomainBed imports wilds and timm at import "
        "time: pip install wilds timm (or this project's [domainbed] extra).")


def source_checkout(package_dir=None):
    """This project's checkout when this package (``package_dir``, default its own folder)
    runs from one (``setup.cfg`` and git metadata beside the package), else None (an
    installed copy)."""
    here = os.path.dirname(os.path.abspath(package_dir or os.path.dirname(__file__)))
    if os.path.isfile(os.path.join(here, "setup.cfg")) and os.path.exists(os.path.join(here, ".git")):
        return here
    return None


def beside_the_checkout(checkout=None):
    """The DomainBed checkout at :data:`BESIDE_THE_CHECKOUT` next to this source checkout
    (``checkout``, default :func:`source_checkout`), or None (none there, an installed
    package, or ``DOMAINBED_VASSO_BESIDE=0``)."""
    if os.environ.get(ENV_BESIDE, "").strip() == "0":
        return None
    checkout = checkout or source_checkout()
    if checkout is None:
        return None
    root = os.path.join(os.path.dirname(checkout), BESIDE_THE_CHECKOUT)
    return os.path.abspath(root) if os.path.isfile(os.path.join(root, "domainbed", "__init__.py")) else None


def domainbed_root():
    """The directory holding the ``domainbed`` package, after making it importable: the
    first of ``DOMAINBED_ROOT``, ``sys.path`` and a checkout beside this source checkout
    (the module's docstring).

    Raises :class:`DomainBedNotFound` with instructions when there is none.
    """
    root = os.environ.get(ENV_ROOT)
    if root:
        root = os.path.abspath(os.path.expanduser(root))
        if not os.path.isfile(os.path.join(root, "domainbed", "__init__.py")):
            raise DomainBedNotFound(_how_to_fix(
                f"{ENV_ROOT}={root} does not contain domainbed/__init__.py."))
        if root not in sys.path:
            sys.path.insert(0, root)
    try:
        spec = importlib.util.find_spec("domainbed")
    except (ImportError, ValueError):
        spec = None
    if (spec is None or not spec.submodule_search_locations) and not root:
        beside = beside_the_checkout()
        if beside is not None:
            sys.path.insert(0, beside)
            importlib.invalidate_caches()
            return beside
    if spec is None or not spec.submodule_search_locations:
        raise DomainBedNotFound(_how_to_fix(
            f"The package 'domainbed' is neither on sys.path nor named by {ENV_ROOT}."))
    return os.path.dirname(os.path.abspath(list(spec.submodule_search_locations)[0]))


def import_domainbed(modules=("algorithms", "hparams_registry", "datasets")):
    """Import and return DomainBed's ``modules`` (by default ``(algorithms, hparams_registry,
    datasets)``), in that order."""
    root = domainbed_root()
    try:
        found = tuple(importlib.import_module(f"domainbed.{name}") for name in modules)
    except DomainBedNotFound:
        raise
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if isinstance(exc, ModuleNotFoundError) and missing and missing.split(".")[0] != "domainbed":
            # DomainBed is there; one of its requirements (torch, wilds, timm, ...) is not
            raise DomainBedNotFound(
                f"DomainBed was found at {root}, but "
                + _missing_module_fix(missing.split(".")[0], "DomainBed")) from exc
        raise DomainBedNotFound(_how_to_fix(
            f"DomainBed was found at {root} but importing it failed: {exc!r}.")) from exc
    return found


def child_pythonpath():
    """A PYTHONPATH under which child processes find both this package and DomainBed."""
    import site
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    installed = set()
    try:
        installed = {os.path.abspath(p) for p in site.getsitepackages() + [site.getusersitepackages()]}
    except AttributeError:  # some virtualenv flavours lack getsitepackages
        pass
    # a pip-installed domainbed_vasso is found anyway: keep site-packages off PYTHONPATH
    entries = ([] if here in installed else [here]) + [domainbed_root()]
    old = os.environ.get("PYTHONPATH")
    if old:
        entries += [e for e in old.split(os.pathsep) if e]
    seen, out = set(), []
    for e in entries:
        if e not in seen:
            seen.add(e)
            out.append(e)
    return os.pathsep.join(out)


def apply_num_workers(datasets_module, value=None):
    """Set ``N_WORKERS`` on every DomainBed dataset class from ``DOMAINBED_VASSO_NUM_WORKERS``.

    DomainBed hard-codes 8 loader workers per environment (``MultipleDomainDataset.N_WORKERS``,
    overridden by a few subclasses) and has no flag for it. Unset: DomainBed's own values.
    Returns the number applied, or None.
    """
    if value is None:
        value = os.environ.get(ENV_WORKERS)
    if value is None or str(value).strip() == "":
        return None
    try:
        n = int(value)
        if n < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV_WORKERS} must be a non-negative integer, got {value!r}") from None
    base = datasets_module.MultipleDomainDataset
    for obj in list(vars(datasets_module).values()):
        if isinstance(obj, type) and issubclass(obj, base):
            obj.N_WORKERS = n
    return n


def apply_resnet_weights(value=None):
    """Honour ``DOMAINBED_VASSO_RESNET_WEIGHTS`` for the ImageNet ResNets DomainBed builds.

    DomainBed's ResNet featurizer calls ``torchvision.models.resnet50(pretrained=True)``
    (resnet18 with ``hparams["resnet18"]``), which downloads
    ``resnet50-0676ba61.pth`` into ``$TORCH_HOME/hub/checkpoints`` unless it is
    there already. Offline, either copy the file there, or set this variable to

    * a path to a torchvision ResNet state dict (``.pth``): loaded instead of the
      download whenever DomainBed asks for pretrained weights;
    * ``none``: build the ResNets (and timm's ``resnet50_augmix`` model) without
      pretrained weights (smoke tests only: accuracies are meaningless).

    Returns the value applied, or None when unset.
    """
    if value is None:
        value = os.environ.get(ENV_WEIGHTS)
    if not value:
        return None
    import torch
    import torchvision

    random_init = value.strip().lower() == "none"
    if not random_init and not os.path.isfile(value):
        raise FileNotFoundError(f"{ENV_WEIGHTS}={value}: no such file (give a torchvision ResNet "
                                "state dict, or 'none' for randomly initialised backbones)")

    def wrap(builder):
        if getattr(builder, "_domainbed_vasso_wrapped", False):
            builder = builder._domainbed_vasso_original

        def build(*args, pretrained=False, weights=None, **kwargs):
            wanted = pretrained or weights is not None
            model = builder(*args, weights=None, **kwargs)
            if wanted and not random_init:
                state = torch.load(value, map_location="cpu", weights_only=True)
                if isinstance(state, dict) and "state_dict" in state:
                    state = state["state_dict"]
                model.load_state_dict(state)
            return model

        build._domainbed_vasso_wrapped = True
        build._domainbed_vasso_original = builder
        build.__name__ = builder.__name__
        return build

    # DomainBed looks the builders up as torchvision.models.resnetXX at call time.
    torchvision.models.resnet50 = wrap(torchvision.models.resnet50)
    torchvision.models.resnet18 = wrap(torchvision.models.resnet18)
    if random_init:
        try:
            import timm
        except ImportError:  # pragma: no cover - DomainBed itself needs timm
            timm = None
        if timm is not None and not getattr(timm.create_model, "_domainbed_vasso_wrapped", False):
            original = timm.create_model

            def create_model(*args, pretrained=False, **kwargs):
                return original(*args, pretrained=False, **kwargs)

            create_model._domainbed_vasso_wrapped = True
            timm.create_model = create_model
    return value
