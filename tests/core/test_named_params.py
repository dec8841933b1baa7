"""named_parameters() and named param groups work on every declared torch: the wrapper
keeps the names, the base optimizer receives plain tensors (torch < 2.5 refuses pairs)."""

import pytest
import torch
from core_helpers import closure_for, make_batches, make_model

from plugins import SAM, VASSO
from plugins.named_params import normalize_param_groups


def _tensors_only(opt):
    return all(isinstance(q, torch.Tensor) for g in opt.base_optimizer.param_groups for q in g["params"])


@pytest.mark.parametrize("base", [torch.optim.SGD, torch.optim.AdamW])
def test_named_parameters_reach_the_base_as_tensors_with_names_kept(base):
    model = make_model()  # no BatchNorm: it would zero the gradient of the bias before it
    opt = VASSO(model.named_parameters(), base, rho=0.1, theta=0.4, lr=0.01)
    assert _tensors_only(opt)
    (group,) = opt.param_groups
    assert group["param_names"] == [n for n, _ in model.named_parameters()]
    assert [id(q) for q in group["params"]] == [id(q) for q in model.parameters()]
    before = [q.detach().clone() for q in model.parameters()]
    x, y = make_batches(1)[0]
    opt.step(closure_for(opt, model, x, y))
    assert all(not torch.equal(b, q) for b, q in zip(before, model.parameters()))


def test_named_param_groups_keep_their_options_and_names():
    model = make_model()
    named = dict(model.named_parameters())
    weights = [(n, q) for n, q in named.items() if n.endswith("weight")]
    biases = [(n, q) for n, q in named.items() if n.endswith("bias")]
    opt = SAM([{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
              torch.optim.AdamW, rho=0.05, lr=1e-3)
    assert _tensors_only(opt)
    assert [g["param_names"] for g in opt.param_groups] == [[n for n, _ in weights], [n for n, _ in biases]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_add_param_group_accepts_names():
    model, head = make_model(), torch.nn.Linear(3, 2)
    opt = SAM(model.named_parameters(), torch.optim.SGD, rho=0.05, lr=0.1)
    opt.add_param_group({"params": list(head.named_parameters()), "lr": 0.01})
    assert _tensors_only(opt)
    assert opt.param_groups[-1]["param_names"] == ["weight", "bias"]
    assert opt.param_groups[-1]["lr"] == 0.01


def test_named_state_dict_round_trip():
    model = make_model()
    opt = VASSO(model.named_parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)
    x, y = make_batches(1)[0]
    opt.step(closure_for(opt, model, x, y))
    again = VASSO(model.named_parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)
    again.load_state_dict(opt.state_dict())
    assert _tensors_only(again)
    assert again.param_groups[0]["param_names"] == opt.param_groups[0]["param_names"]


def test_mixing_named_and_unnamed_is_refused_with_a_clear_message():
    model = make_model()
    (n0, q0), *rest = model.named_parameters()
    with pytest.raises(ValueError, match="with/without names"):
        SAM([(n0, q0)] + [q for _, q in rest], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="with/without names"):
        SAM([{"params": [(n0, q0)]}, {"params": [q for _, q in rest]}], torch.optim.SGD, lr=0.1)


def test_inputs_torch_refuses_are_left_for_torch_to_report():
    q = torch.nn.Parameter(torch.zeros(2))
    assert normalize_param_groups(q) is q
    with pytest.raises(TypeError):
        SAM(q, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="empty"):
        SAM([], torch.optim.SGD, lr=0.1)
