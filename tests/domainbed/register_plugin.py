"""A pytest plugin (``-p register_plugin``) for running DomainBed's own test suite with
this package registered: ``domainbed_vasso.register()`` runs before DomainBed's test
modules are imported (they parametrize over ``algorithms.ALGORITHMS`` at import time).

* ``VASSO_SUITE_REGISTER=0``: do not register (the same suite as DomainBed alone, to
  tell a failure of DomainBed in this environment from one that register() causes).
* DomainBed's tests call ``.cuda()`` throughout; without CUDA, ``Tensor.cuda`` and
  ``Module.cuda`` return the CPU object, so that they run on the CPU.
* ``VASSO_SUITE_DEBUG224=VASSO,...``: run ``test_init_update_predict`` on Debug224
  (a ResNet-50 per algorithm, minutes each on a CPU) for these algorithms only, none where
  it is empty; every algorithm still runs it on Debug28.
"""

import os
import re

import torch


def pytest_configure(config):
    if os.environ.get("VASSO_SUITE_REGISTER", "1") != "0":
        import domainbed_vasso
        domainbed_vasso.register()
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def pytest_collection_modifyitems(config, items):
    wanted = os.environ.get("VASSO_SUITE_DEBUG224")
    if wanted is None:
        return
    wanted = set(filter(None, wanted.split(",")))
    from domainbed import algorithms
    n = len(algorithms.ALGORITHMS)
    kept, dropped = [], []
    for item in items:
        # parameterized names the cases of product(DEBUG_DATASETS, ALGORITHMS) by index
        m = re.fullmatch(r"test_init_update_predict_(\d+)_Debug224", item.name)
        if m and algorithms.ALGORITHMS[int(m.group(1)) - n] not in wanted:
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
