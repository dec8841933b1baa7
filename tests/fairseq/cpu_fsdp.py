"""fairseq's ``--ddp-backend fully_sharded`` on a CPU, for the tests: fairscale's
FullyShardedDataParallel computes on CUDA only because fairseq 0.12 gives it no device
(it takes ``torch.cuda.current_device()``) and because it orders its work on CUDA streams.
These patches give it the CPU and make the streams no-ops (one CPU stream: the order is
the program's), and let the plugin's CPU refusal of fully_sharded through.  fairscale's
sharding, flattening, all-gathers, reduce-scatters, mixed precision and fairseq's Trainer,
FSDP wrapper and checkpointing run unchanged.  Not for users: fairscale does not support
this (no CPU device is tested by it)."""

import contextlib

import torch


class _Stream:
    """A CUDA stream stand-in: everything on a CPU is ordered already."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event

    def wait_event(self, event):
        pass


_CURRENT = [_Stream()]


def _current_stream(device=None):
    return _CURRENT[-1]


@contextlib.contextmanager
def _stream(stream):
    _CURRENT.append(stream if stream is not None else _CURRENT[-1])
    try:
        yield
    finally:
        _CURRENT.pop()


@contextlib.contextmanager
def fresh_all_gather_outputs():
    """fairscale's ``_gather_optim_state`` gathers every optimizer buffer (``exp_avg``,
    ``exp_avg_sq``, ``sam_slope``) into one reused list of outputs and keeps ``x.cpu()`` of
    each: a copy from a GPU, the same tensor on the CPU, where every buffer would then alias
    the last one gathered.  Inside this block ``all_gather`` fills fresh outputs into the
    caller's list, which gives the CPU the GPU's semantics."""
    import torch.distributed as dist

    real = dist.all_gather

    def all_gather(outputs, tensor, *args, **kwargs):
        fresh = [torch.empty_like(o) for o in outputs]
        work = real(fresh, tensor, *args, **kwargs)
        outputs[:] = fresh
        return work

    dist.all_gather = all_gather
    try:
        yield
    finally:
        dist.all_gather = real


def cpu_fsdp_patches():
    """``(owner, attribute, value)`` to set before fairseq builds the model."""
    import copy

    from fairscale.internal import reduce_scatter_bucketer
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    import fairseq_vasso.hooks as hooks

    stock_setup_streams = fsdp.FullyShardedDataParallel._setup_streams

    def setup_streams(self):
        stock_setup_streams(self)  # shares its (empty, without CUDA) dict with the children
        if self._is_root and not self._streams:
            self._streams.update(fp32_to_fp16=_Stream(), all_gather=_Stream(), post_backward=_Stream())

    stock_gather_optim_state = fsdp.FullyShardedDataParallel._gather_optim_state

    def gather_optim_state(self, sd_state):
        with fresh_all_gather_outputs():
            return stock_gather_optim_state(self, sd_state)

    stock_check_config = hooks.check_config

    def check_config(cfg):  # the plugin's checks, as on a GPU (its refusal says FSDP needs CUDA)
        cfg = copy.deepcopy(cfg)
        if hasattr(cfg, "common"):
            cfg.common.cpu = False
        else:
            cfg.cpu = False
        saved, torch.cuda.is_available = torch.cuda.is_available, lambda: True
        try:
            stock_check_config(cfg)
        finally:
            torch.cuda.is_available = saved

    return [
        (fsdp, "_get_default_cuda_device", lambda module: torch.device("cpu")),
        (fsdp.FullyShardedDataParallel, "_setup_streams", setup_streams),
        (fsdp.FullyShardedDataParallel, "_gather_optim_state", gather_optim_state),
        # gloo's reduce_scatter_single wants 1-D tensors; the list form, fairscale's other path, runs
        (fsdp, "enable_nccl_base_collectives", False),
        (reduce_scatter_bucketer, "enable_nccl_base_collectives", False),
        (torch.cuda, "Stream", _Stream),
        (torch.cuda, "current_stream", _current_stream),
        (torch.cuda, "stream", _stream),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.Tensor, "record_stream", lambda self, stream: None),
        # fairseq's Trainer.clip_grad_norm sums the ranks' norms under FSDP on total_norm.cuda()
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        (hooks, "check_config", check_config),
    ]
