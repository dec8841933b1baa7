"""Bad arguments fail before any step, naming the argument and its range."""

import pytest
import torch

from plugins import SAM, VASSO
from core_helpers import make_model


@pytest.mark.parametrize("cls, kwargs, needle", [
    (SAM, {"rho": -1.0}, "rho must be in [0, inf)"),
    (SAM, {"rho": float("nan")}, "rho must be in"),
    (SAM, {"rho": float("inf")}, "rho must be in"),
    (SAM, {"rho": "0.1"}, "rho must be a real number"),
    (VASSO, {"theta": 0.0}, "theta must be in (0, 1]"),
    (VASSO, {"theta": 1.5}, "theta must be in (0, 1]"),
    (VASSO, {"theta": -0.2}, "theta must be in (0, 1]"),
    (VASSO, {"theta": None}, "theta must be in (0, 1]"),
    (SAM, {"p": 1.01}, "p must be in [0, 1]"),
    (VASSO, {"p": -0.1}, "p must be in [0, 1]"),
    (SAM, {"eta": -0.01}, "eta must be in [0, inf)"),
    (VASSO, {"gsam_alpha": -0.5}, "gsam_alpha must be in [0, inf)"),
    (SAM, {"adaptive": "yes"}, "adaptive must be True or False"),
    (SAM, {"seed": 1.5}, "seed must be an integer"),
])
def test_bad_argument_names_itself_and_range(cls, kwargs, needle):
    model = make_model()
    with pytest.raises(ValueError) as info:
        cls(model.parameters(), torch.optim.SGD, lr=0.1, **kwargs)
    assert needle in str(info.value)


def test_base_optimizer_over_other_parameters_is_refused():
    model, other = make_model(0), make_model(1)
    base = torch.optim.Adam(other.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="base_optimizer must optimize exactly the parameters"):
        VASSO(model.parameters(), base)
    partial = torch.optim.Adam(list(model.parameters())[:2], lr=1e-3)
    with pytest.raises(ValueError, match="base_optimizer must optimize exactly the parameters"):
        SAM(model.parameters(), partial)


def test_base_optimizer_must_be_an_optimizer():
    with pytest.raises(ValueError, match="base_optimizer must be a torch.optim.Optimizer"):
        SAM(make_model().parameters(), "adamw", lr=0.1)


def test_built_base_optimizer_rejects_extra_kwargs():
    model = make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="unexpected keyword arguments"):
        SAM(model.parameters(), base, lr=0.2)


def test_integer_rho_is_accepted_as_float():
    opt = SAM(make_model().parameters(), torch.optim.SGD, rho=1, lr=0.1)
    assert isinstance(opt.rho, float) and opt.rho == 1.0


def test_step_without_closure_explains_the_explicit_api():
    opt = SAM(make_model().parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="perturb\\(\\) and descend\\(\\)"):
        opt.step()


def test_explicit_api_misuse_is_caught():
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match="descend\\(\\) without perturb\\(\\)"):
        opt.descend()
    model(torch.randn(4, 6)).sum().backward()
    opt.perturb()
    with pytest.raises(RuntimeError, match="perturb\\(\\) called twice"):
        opt.perturb()
    with pytest.raises(RuntimeError, match="middle of a step"):
        opt.state_dict()
    opt.descend()
    opt.state_dict()


@pytest.mark.parametrize("knob, value, needle", [
    ("rho", -1, "rho must be in [0, inf), got -1"),
    ("theta", 0.0, "theta must be in (0, 1], got 0.0"),
    ("p", "0.5", "p must be a real number in [0, 1]"),
    ("adaptive", 1, "adaptive must be True or False"),
    ("seed", 0.5, "seed must be an integer"),
])
def test_the_validator_names_the_knob_and_its_range(knob, value, needle):
    from plugins.validation import check

    with pytest.raises(ValueError) as info:
        check(knob, value)
    assert needle in str(info.value)


def test_the_validator_speaks_each_hosts_vocabulary():
    from plugins.validation import Range, check

    with pytest.raises(ValueError, match=r"^--rho must be in \[0, inf\), got -1.0$"):
        check("rho", "-1", name="--rho", parse=True)
    with pytest.raises(ValueError, match=r"^--theta must be a real number in \(0, 1\], got 'x'$"):
        check("theta", "x", name="--theta", parse=True)
    with pytest.raises(ValueError, match=r"^p must be in \(0, 1\], got 0$"):
        check("p", 0, within=Range(0.0, 1.0, "(]"))
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        check("adaptive", "yes", words=("true", "false"))
    assert check("rho", "0.25", parse=True) == 0.25 and check("rho_min", None) is None


def test_every_constructor_knob_is_in_the_validators_table():
    import inspect

    from plugins import SharpnessAware
    from plugins.validation import KNOBS

    knobs = [n for n, p in inspect.signature(SharpnessAware).parameters.items()
             if p.kind == p.KEYWORD_ONLY or n == "rho"]
    assert knobs and all(k in KNOBS for k in knobs), [k for k in knobs if k not in KNOBS]
