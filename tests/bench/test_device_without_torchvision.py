"""scripts/benchmark/benchmark.py --device where torchvision cannot be imported (a GPU node that brings
torch alone): the default models are those that need no torchvision, and the report says which
was left out and why; a model named with --models that needs it is refused, naming the fix."""

import sys

import pytest


@pytest.fixture
def without_torchvision(monkeypatch):
    """This process as one where torchvision is not installed (``None`` in sys.modules: no spec,
    and its import raises)."""
    monkeypatch.setitem(sys.modules, "torchvision", None)
    from vasso_bench.cli import main
    return main


def test_the_default_models_are_those_that_need_no_torchvision(without_torchvision, tmp_path, capsys):
    md = tmp_path / "device.md"
    assert without_torchvision(["--device", "cpu", "--rows", "adamw-2pass", "VASSO", "--rounds", "1", "--warmup",
                                "0", "--markdown", str(md)]) == 0
    err = capsys.readouterr().err
    assert "benchmark.py: resnet50 left out: it needs torchvision (not installed; pip install torchvision" in err
    assert "running transformer" in err
    text = md.read_text()
    assert "Left out: the model resnet50, which needs torchvision (not installed;" in text
    assert "### transformer:" in text and "### resnet50" not in text


def test_resnet50_named_without_torchvision_is_refused(without_torchvision, capsys):
    with pytest.raises(SystemExit) as exc:
        without_torchvision(["--device", "cpu", "--models", "resnet50"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --models resnet50 needs torchvision (not installed; pip install torchvision" in last
    assert "--models transformer runs without it" in last
