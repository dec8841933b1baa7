"""The house (docs/design.md, "The house"): the core imports no host, the translation
tools import no fairseq, and SAM / VASSO show every keyword of the family."""

import inspect
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


@pytest.mark.parametrize("module", ["recipe", "toy_corpus", "iwslt14", "bleu", "logs", "demo", "bench"])
def test_translation_tools_import_no_fairseq(module):
    loaded = _modules_after(f"import fairseq_vasso.nmt.{module}")
    assert "fairseq" not in loaded and "fairseq_vasso.hooks" not in loaded


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
