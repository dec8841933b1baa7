"""A pytest plugin (``-p register_plugin``) that runs DomainBed's own test suite with
this package registered: ``domainbed_vasso.register()`` before DomainBed's test modules
are imported (they parametrize over ``algorithms.ALGORITHMS`` at import time).

DomainBed's tests call ``.cuda()`` throughout; on a machine without CUDA this plugin
makes ``Tensor.cuda`` and ``Module.cuda`` return the CPU object, so that they run there.
"""

import torch


def pytest_configure(config):
    import domainbed_vasso
    domainbed_vasso.register()
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self
        torch.nn.Module.cuda = lambda self, *args, **kwargs: self
