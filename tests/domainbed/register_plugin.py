"""A pytest plugin (``-p register_plugin``) for running DomainBed's own test suite with
this package registered: ``domainbed_vasso.register()`` runs before DomainBed's test
modules are imported (they parametrize over ``algorithms.ALGORITHMS`` at import time).

* ``VASSO_SUITE_REGISTER=0``: do not register (the same suite as DomainBed alone, to
  tell a failure of DomainBed in this environment from one that register() causes).
* DomainBed's tests call ``.cuda()`` throughout; without CUDA, ``Tensor.cuda`` and
  ``Module.cuda`` return the CPU object, so that they run on the CPU.
* ``VASSO_SUITE_DEBUG224=0``: deselect ``test_init_update_predict`` on Debug224 (a
  ResNet-50 per algorithm, minutes each on a CPU); every algorithm still runs it on Debug28.
* DomainBed's train and sweep tests write into ``/tmp/<uuid4>`` (hard-coded, so TMPDIR
  cannot move them) and leave it: the session removes the folders named by the uuid4
  values this process drew, and nothing else.
"""

import os
import shutil
import uuid

import torch

_DRAWN = []  # the uuid4 values DomainBed's tests drew in this process


def _recording(uuid4):
    def recorded():
        value = uuid4()
        _DRAWN.append(str(value))
        return value
    return recorded


def pytest_sessionfinish(session, exitstatus):
    for name in _DRAWN:
        path = os.path.join("/tmp", name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def pytest_configure(config):
    uuid.uuid4 = _recording(uuid.uuid4)
    if os.environ.get("VASSO_SUITE_REGISTER", "1") != "0":
        import domainbed_vasso
        domainbed_vasso.register()
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def pytest_collection_modifyitems(config, items):
    if os.environ.get("VASSO_SUITE_DEBUG224", "1") != "0":
        return
    # parametrized over product(DEBUG_DATASETS, ALGORITHMS): test_init_update_predict_<index>_<dataset>
    dropped = [item for item in items
               if item.name.startswith("test_init_update_predict_") and item.name.endswith("_Debug224")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]
