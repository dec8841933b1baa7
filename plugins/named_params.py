"""Parameter groups with names, the same on every torch version.

torch >= 2.5 accepts ``model.named_parameters()`` and keeps the names under a group's
``"param_names"`` key; older torch raises ``TypeError`` on the ``(name, tensor)``
tuples.  :func:`normalize_param_groups` does that conversion here, before torch sees
the groups, so the wrapper reads names from ``group["param_names"]`` everywhere and
the base optimizer only ever receives plain tensors.

    >>> import torch
    >>> groups = normalize_param_groups(torch.nn.Linear(2, 1).named_parameters())
    >>> groups[0]["param_names"], [tuple(q.shape) for q in groups[0]["params"]]
    (['weight', 'bias'], [(1, 2), (1,)])
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

__all__ = ["normalize_param_groups", "normalize_param_group"]


def normalize_param_group(group: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of ``group`` whose ``"params"`` holds tensors only, with ``"param_names"``
    (same order) when the parameters came as ``(name, tensor)`` pairs.

    Anything that is not a recognisable group is returned as is, so that torch reports
    it with its own message (a set of parameters, a non-tensor, ...).
    """
    if not isinstance(group, dict) or "params" not in group:
        return group
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, (set, frozenset)):
        return group  # torch refuses unordered collections, with its own message
    else:
        params = list(params)
    named = [isinstance(q, tuple) for q in params]
    if not any(named):
        return {**group, "params": params}
    if not all(named):
        raise ValueError("all optimizer params should be with/without names: "
                         "pass model.named_parameters() or model.parameters(), not a mix")
    for q in params:
        if len(q) != 2 or not isinstance(q[0], str):
            raise TypeError(f"a named parameter must be a (str, Tensor) pair, got {type(q).__name__} of "
                            f"{tuple(type(x).__name__ for x in q)}")
    if "param_names" in group:
        raise ValueError("a param group gives names twice: as (name, tensor) pairs and as 'param_names'")
    return {**group, "params": [q for _, q in params], "param_names": [name for name, _ in params]}


def normalize_param_groups(params) -> Any:
    """``params`` as torch >= 2.5 would store it: a list of group dicts holding tensors
    in ``"params"`` and, when named, their names in ``"param_names"``.

    Accepts what torch optimizers accept (an iterable of tensors, of ``(name, tensor)``
    pairs, or of group dicts with either).  Inputs torch itself refuses (a lone tensor,
    a set, an empty list) are returned unchanged for torch to report.
    """
    if isinstance(params, (torch.Tensor, set, frozenset)):
        return params
    params = list(params)
    if not params:
        return params
    groups: List[Any] = params if isinstance(params[0], dict) else [{"params": params}]
    groups = [normalize_param_group(g) for g in groups]
    with_names = {isinstance(g, dict) and "param_names" in g for g in groups}
    if len(with_names) > 1:
        raise ValueError("all optimizer param groups should be with/without names: "
                         "name the parameters of every group or of none")
    return groups
