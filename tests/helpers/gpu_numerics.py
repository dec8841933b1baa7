"""The kernels a comparison between two computations on a GPU needs: :func:`comparing`.

On a CPU nothing here changes a result (the flags are CUDA's), so a test parametrized over
the CPU and a GPU wears it for both.  What each mode sets, and why:

* :data:`BIT_FOR_BIT` (``torch.equal``, ``atol=0``): cuDNN deterministic and not autotuned
  (``benchmark=False``).  Otherwise cuDNN may pick, run by run, a different convolution
  algorithm, or one whose backward adds with atomics in any order: two runs of the same
  steps then differ in the last bits.  TF32 is left as it is: both runs take the same kernels,
  TF32 or not.  (cuBLAS is deterministic on one stream without this.)
* :data:`WITHIN_TOLERANCE` (``assert_close`` with an ``rtol`` of 1e-5 or so): the same, and
  TF32 off for matmuls and for cuDNN's convolutions, whose TF32 is on by default (10 bits of
  mantissa: a 1e-3 relative error per product, which a few steps carry far past the
  tolerance that float32 paths compared with each other are held to).

Use it around what the comparison runs, as a ``with`` block or as a decorator of the test::

    @comparing(BIT_FOR_BIT)
    def test_...(device): ...
"""

import contextlib

import torch

BIT_FOR_BIT = "bit for bit"
WITHIN_TOLERANCE = "within a tolerance"


@contextlib.contextmanager
def comparing(how: str):
    """cuDNN deterministic, and with ``WITHIN_TOLERANCE`` TF32 off too, inside; every flag
    as it was after (the module docstring says why)."""
    if how not in (BIT_FOR_BIT, WITHIN_TOLERANCE):
        raise ValueError(f"comparing({how!r}): BIT_FOR_BIT or WITHIN_TOLERANCE")
    exact = how == WITHIN_TOLERANCE
    cudnn_tf32 = False if exact else torch.backends.cudnn.allow_tf32
    matmul_tf32 = torch.backends.cuda.matmul.allow_tf32
    # torch's own context manager for cuDNN's flags (it restores them); the legacy allow_tf32
    # flags, which every torch from the floor (2.1) to the newest reads and keeps consistent
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False, deterministic=True,
                                    allow_tf32=cudnn_tf32):
        try:
            if exact:
                torch.backends.cuda.matmul.allow_tf32 = False
            yield
        finally:
            if exact:
                torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
