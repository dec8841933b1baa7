"""tests/helpers/gpu_numerics.comparing: the flags it sets for each kind of comparison, and that it
gives back the ones it found, after an error too (torch keeps them on a CPU as on a GPU)."""

import pytest
import torch
from gpu_numerics import BIT_FOR_BIT, WITHIN_TOLERANCE, comparing

BACKENDS = torch.backends


def flags():
    return {"deterministic": BACKENDS.cudnn.deterministic, "benchmark": BACKENDS.cudnn.benchmark,
            "cudnn_tf32": BACKENDS.cudnn.allow_tf32, "matmul_tf32": BACKENDS.cuda.matmul.allow_tf32}


@pytest.fixture
def user_flags():
    """A user's settings, the opposite of what a comparison needs; this session's given back after."""
    before = flags()
    BACKENDS.cudnn.deterministic, BACKENDS.cudnn.benchmark = False, True
    BACKENDS.cudnn.allow_tf32, BACKENDS.cuda.matmul.allow_tf32 = True, True
    yield flags()
    BACKENDS.cudnn.deterministic, BACKENDS.cudnn.benchmark = before["deterministic"], before["benchmark"]
    BACKENDS.cudnn.allow_tf32, BACKENDS.cuda.matmul.allow_tf32 = before["cudnn_tf32"], before["matmul_tf32"]


@pytest.mark.parametrize("how, inside", [
    (BIT_FOR_BIT, {"deterministic": True, "benchmark": False, "cudnn_tf32": True, "matmul_tf32": True}),
    (WITHIN_TOLERANCE, {"deterministic": True, "benchmark": False, "cudnn_tf32": False, "matmul_tf32": False}),
])
def test_a_comparison_gets_its_kernels_and_gives_the_flags_back(user_flags, how, inside):
    with comparing(how):
        assert flags() == inside
    assert flags() == user_flags
    with pytest.raises(RuntimeError, match="a test that failed"):
        with comparing(how):
            raise RuntimeError("a test that failed")
    assert flags() == user_flags


def test_as_a_decorator_each_call_gets_the_flags(user_flags):
    seen = []

    @comparing(WITHIN_TOLERANCE)
    def compared(x):
        seen.append(flags()["matmul_tf32"])
        return x

    assert compared(1) == 1 and compared(2) == 2 and seen == [False, False]
    assert flags() == user_flags


def test_an_unknown_comparison_is_refused():
    with pytest.raises(ValueError, match="BIT_FOR_BIT or WITHIN_TOLERANCE"):
        with comparing("roughly"):
            pass
