"""The house (docs/design.md, "The house"): the core imports no host, the translation
tools import no fairseq, and SAM / VASSO show every keyword of the family."""

import ast
import inspect
import os
import subprocess
import sys

import pytest

import plugins


def _modules_after(code):
    """The top-level modules a fresh interpreter holds after running ``code``."""
    out = subprocess.run([sys.executable, "-c", code + "; import sys; print(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_core_imports_no_host_and_no_lab():
    loaded = _modules_after("import plugins; plugins.SAM, plugins.VASSO, plugins.rng_state")
    assert "plugins.optimizer" in loaded
    assert not {"fairseq", "domainbed", "fairseq_vasso", "domainbed_vasso", "matplotlib"} & loaded
    assert not any(m.startswith("plugins.lab") for m in loaded)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# docs/design.md, "The house": what each floor may import of the project's other floors,
# at module level or inside a function alike (a lazy import is an arrow too)
HOUSE = {
    "plugins": set(),
    "plugins.lab": {"plugins"},
    "fairseq_vasso": {"plugins"},
    "fairseq_vasso.nmt": {"plugins", "plugins.lab"},
    "domainbed_vasso": {"plugins", "plugins.lab"},
}


def _floor(module):
    parts = module.split(".")
    if parts[0] in ("plugins", "fairseq_vasso") and len(parts) > 1 and parts[1] in ("lab", "nmt"):
        return ".".join(parts[:2])
    return parts[0]


def _project_imports():
    """(importing module, imported module) for every import statement of the three packages."""
    for package in ("plugins", "fairseq_vasso", "domainbed_vasso"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                package_of = module.rsplit(".", 1)[0]
                if name == "__init__.py":
                    module = package_of
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        targets = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.level:
                        base = package_of.split(".")[:len(package_of.split(".")) - node.level + 1]
                        targets = [".".join(base + ([node.module] if node.module else []))]
                    elif isinstance(node, ast.ImportFrom):
                        targets = [node.module]
                    else:
                        continue
                    for target in targets:
                        if target.split(".")[0] in ("plugins", "fairseq_vasso", "domainbed_vasso"):
                            yield module, target


def test_every_import_follows_the_house_map():
    edges = list(_project_imports())
    assert ("fairseq_vasso.nmt.logs", "plugins.lab.runs") in edges  # the walk sees what it must
    wrong = sorted(f"{a} imports {b}" for a, b in edges
                   if _floor(b) != _floor(a) and _floor(b) not in HOUSE[_floor(a)])
    assert not wrong, "imports against docs/design.md's map:\n  " + "\n  ".join(wrong)


def test_run_readers_point_down_to_the_lab():
    """vasso-plot's run type is the lab's; the hosts' readers import it (and neither the
    plots nor their hosts' tools), and the lab finds the readers by name when it loads a
    run (that the lab imports no host is test_every_import_follows_the_house_map's)."""
    loaded = _modules_after("import fairseq_vasso.nmt.logs, domainbed_vasso.logs")
    assert "plugins.lab.runs" in loaded
    assert "plugins.lab.plot" not in loaded and "matplotlib" not in loaded
    assert not {"fairseq", "domainbed"} & loaded
    from plugins.lab import runs
    for reader in runs.READERS:
        module = __import__(reader, fromlist=["load_run"])
        assert module.load_run.__annotations__["return"] in ("Run", runs.Run)
        assert callable(module.claims) and module.FILE_NAMES


def test_translation_tools_import_no_fairseq():
    # one interpreter imports them one after the other, printing after each what it holds: the
    # first that pulls fairseq in is named (a fresh interpreter each costs seconds of torch import)
    tools = sorted(name[:-3] for name in os.listdir(os.path.join(REPO, "fairseq_vasso", "nmt"))
                   if name.endswith(".py") and name != "__init__.py")
    assert {"bleu", "selftest"} <= set(tools)
    code = ("import sys\n"
            f"for name in {tools!r}:\n"
            "    __import__('fairseq_vasso.nmt.' + name)\n"
            "    print(name, 'fairseq' in sys.modules, 'fairseq_vasso.hooks' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:-1] == [f"{name} False False" for name in tools], out.stdout


def test_importing_fairseq_later_registers_the_plugin():
    """A script that imports fairseq_vasso (or one of its tools) before fairseq still finds
    the optimizers and the hooks once fairseq is imported."""
    pytest.importorskip("fairseq")
    code = ("import fairseq_vasso.nmt.toy_corpus, fairseq; from fairseq.optim import OPTIMIZER_REGISTRY; "
            "from fairseq.trainer import Trainer; from fairseq import options; "
            "assert {'sam', 'vasso'} <= set(OPTIMIZER_REGISTRY); "
            "assert Trainer.train_step._fairseq_vasso_hook and options.parse_args_and_arch._fairseq_vasso_hook")
    assert "fairseq_vasso.hooks" in _modules_after(code)


def test_family_signatures_derive_from_sharpness_aware():
    """SAM and VASSO forward the family's keywords: one declaration, every keyword visible."""
    family = inspect.signature(plugins.SharpnessAware)
    sam, vasso = inspect.signature(plugins.SAM), inspect.signature(plugins.VASSO)
    assert list(sam.parameters) == [p for p in family.parameters if p != "theta"]
    assert sorted(vasso.parameters) == sorted(family.parameters)
    assert vasso.parameters["theta"].default == 0.4 and family.parameters["theta"].default is None
    for name, p in sam.parameters.items():
        assert p.default == family.parameters[name].default and p.kind == family.parameters[name].kind
    with pytest.raises(ValueError, match="SAM takes no theta"):
        plugins.SAM([plugins.optimizer.torch.zeros(1, requires_grad=True)], plugins.optimizer.torch.optim.SGD,
                    theta=0.4, lr=0.1)
