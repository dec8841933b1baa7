"""fairseq's ``--cpu`` in the tests: the same runs on a CPU-only host and on a GPU host.

Stock fairseq's ``--cpu`` still uses a GPU it can see. Its ``utils.clip_grad_norm_``, called on
every update, puts the gradient norm on ``torch.cuda.current_device()`` whenever CUDA is
available (with more than one gradient and no apex), so ``--cpu --clip-norm X`` (X > 0) stops
with "scalar tensor is expected to be on cpu but is on cuda:0" on a GPU host; at the default
``--clip-norm 0`` the norm still goes through the GPU. And its default
``--distributed-world-size`` is the number of GPUs seen when fairseq was imported. The tests'
``--cpu`` runs are the CPU proofs, so they see no GPU wherever they run:

* a child that runs fairseq with ``--cpu`` gets :func:`env`, ``CUDA_VISIBLE_DEVICES`` empty
  (the library's ``fairseq_vasso.nmt.recipe.cpu_only_env``, which the self-test, the demo's
  ``--cpu`` and the benchmark give their children);
* a run in the test's own process (``tests/fairseq/conftest.py``'s ``train``) runs inside
  :func:`in_process`, where torch reports no CUDA device, as it does in such a child, and names
  its world size (``model_args``: ``--distributed-world-size 1``). fairseq itself is not patched.
"""

import contextlib

import torch


def env(base=None):
    """``base`` (default ``os.environ``) for a child that runs fairseq with ``--cpu``: no GPU visible."""
    from fairseq_vasso.nmt.recipe import cpu_only_env  # here: importing this module imports no fairseq_vasso

    return cpu_only_env(base)


@contextlib.contextmanager
def in_process():
    """While inside, torch in this process reports no CUDA device (``is_available()`` False,
    ``device_count()`` 0), as ``CUDA_VISIBLE_DEVICES=`` makes it report in a child: a GPU test
    that ran before in the same session keeps its CUDA context, but fairseq's ``--cpu`` code
    takes its CPU paths, as on a CPU-only host."""
    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: False), (lambda: 0)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved
