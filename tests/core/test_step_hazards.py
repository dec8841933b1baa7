"""Hazards of the step decided on the device that a reading of the code found, each pinned
by a test that fails without its fix (docs/design.md, "The step"):

* GSAM's correction factor in the gradients' dtype (a float64 scalar sends CUDA's foreach
  ops to one kernel per tensor);
* norms and inner products over flat buffers of any length (cuBLAS's dot takes a 32-bit
  length), checked with a small chunk; fp16/bf16 ones in float32;
* a read-only finiteness check of ``h_t``;
* a skipped step leaves a fused base's state as it was, its first step included;
* the verdicts' pinned host slots reused;
* a model split over two GPUs in one process (needs two CUDA devices);
* ranks that sum different dtypes of a sharded model take its sums in one dtype.
"""

import copy
import math

import pytest
import torch

from plugins import SAM, VASSO, device_step, ondevice, reductions
from core_helpers import Dispatched, build, closure_for, make_batches, make_model
from gpu_numerics import WITHIN_TOLERANCE, comparing


def warm(kind, steps=2, base=torch.optim.SGD, dtype=torch.float32, **kw):
    """A model and an optimizer after ``steps`` steps: later steps are decided on the device."""
    model = make_model().to(dtype)
    opt = build(kind, model.parameters(), base, lr=0.05, rho=0.2, **kw)
    for x, y in make_batches(steps):
        opt.step(closure_for(opt, model, x.to(dtype), y))
    assert opt._lists.flat_slope is not None
    return model, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["GSAM", "V+G"])
def test_gsams_factor_multiplies_the_gradients_in_their_own_dtype(kind, dtype):
    """float32 gradients: a float32 factor (not the sums' float64); bf16 ones: float32 too,
    in which a factor near 1 is not rounded to 1."""
    model, opt = warm(kind, dtype=dtype)
    x, y = make_batches(3, seed=5)[2]
    with Dispatched("_foreach_mul_", "_foreach_mul") as rec:
        opt.step(closure_for(opt, model, x.to(dtype), y))
    scalars = [a[1] for _, a in rec.calls if torch.is_tensor(a[1])]
    assert scalars, "GSAM's correction made no foreach product with a tensor scalar"
    assert {s.dtype for s in scalars} == {torch.float32}, [s.dtype for s in scalars]


def test_long_dot_and_norm_take_pieces_below_the_chunk(monkeypatch):
    monkeypatch.setattr(reductions, "LONG_CHUNK", 10)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(55, generator=g), torch.randn(55, generator=g)  # 6 pieces
    with Dispatched("dot", "linalg_vector_norm") as rec:
        dot, norm = reductions.long_dot(x, y), reductions.long_norm(x)
    assert len(rec.calls) == 6 + 7 and max(a[0].numel() for _, a in rec.calls) <= 10
    assert dot.item() == pytest.approx(torch.dot(x.double(), y.double()).item(), abs=1e-5)
    assert norm.item() == pytest.approx(x.double().norm().item(), rel=1e-6)
    short = torch.randn(10, generator=g)  # up to the chunk: one kernel, torch's own rounding
    assert torch.equal(reductions.long_dot(short, short), torch.dot(short, short))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_norms_and_dots_are_taken_in_float32_in_pieces(dtype, monkeypatch):
    """fp16/bf16 flat buffers reduce in float32: fp16's own norm of finite elements
    overflows at 65504, and a dot rounded to 8 bits would swamp the stability's difference.
    The widened copies stay under WIDE_CHUNK elements."""
    big = torch.full((200_000,), 200.0, dtype=dtype)  # ||big|| = 89,443: past fp16's range
    assert reductions.long_norm(big).item() == pytest.approx(200.0 * math.sqrt(200_000), rel=1e-6)
    assert torch.isfinite(ondevice.total_norm([big, big[:10]])).item()
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(55, generator=g).to(dtype) for _ in range(2))
    exact = torch.dot(x.double(), y.double()).item()
    monkeypatch.setattr(reductions, "WIDE_CHUNK", 10)
    with Dispatched("dot") as rec:
        dot = reductions.long_dot(x, y)
    assert dot.dtype == torch.float32 and dot.item() == pytest.approx(exact, rel=1e-6, abs=1e-6)
    assert len(rec.calls) == 6 and all(a[0].numel() <= 10 and a[0].dtype == torch.float32 for _, a in rec.calls)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_host_paths_norm_of_large_low_precision_tensors_makes_no_float32_copy(dtype):
    """The host path's sums (reductions.Sums, what ZeRO/OSS steps take) widen a large fp16/bf16
    tensor inside the norm's kernel: a float32 copy of it would double its memory for the
    reduction (a 33M-element embedding: 132 MB more), for the same bits."""
    g = torch.Generator().manual_seed(0)
    big = [(torch.randn(reductions.FLAT_BELOW + 5, generator=g) * 300).to(dtype) for _ in range(2)]
    with Dispatched("_to_copy") as rec:
        norm = reductions.global_norm(big)
    widened = [a[0].numel() for _, a in rec.calls if a[0].numel() > 1]
    assert widened == [], widened
    exact = math.sqrt(sum(t.double().square().sum().item() for t in big))
    assert norm.item() == pytest.approx(exact, rel=1e-5)  # (float32 sums of 32,773 squares)


@pytest.mark.parametrize("kind", ["SAM", "VASSO", "eVASSO", "ASAM"])
def test_the_device_step_reduces_its_flat_buffers_in_pieces(kind, monkeypatch):
    """Every dot and norm of a step over the flat buffers stays under the chunk, and the step
    trains as the one-piece step does, up to the rounding of adding the pieces."""
    results = []
    for chunk in (reductions.LONG_CHUNK, 13):
        monkeypatch.setattr(reductions, "LONG_CHUNK", chunk)
        model, opt = warm(kind)
        x, y = make_batches(3, seed=5)[2]
        with Dispatched("dot", "linalg_vector_norm") as rec:
            opt.step(closure_for(opt, model, x, y))
        results.append((torch.cat([q.detach().reshape(-1) for q in model.parameters()]), opt.diagnostics["stability"]))
    assert max(a[0].numel() for _, a in rec.calls) <= 13
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    assert results[1][1] == pytest.approx(results[0][1], rel=1e-4, nan_ok=True)


@pytest.mark.parametrize("kind", ["SAM", "VASSO"])
def test_the_finiteness_check_of_h_leaves_the_gradients_unwritten(kind):
    model, opt = warm(kind)
    x, y = make_batches(3, seed=5)[2]
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert opt.perturb()
    model.zero_grad()
    with opt.second_pass(model):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    versions = [q.grad._version for q in model.parameters()]
    with Dispatched("_amp_foreach_non_finite_check_and_unscale_") as rec:
        opt.descend()
    assert [q.grad._version for q in model.parameters()] == versions
    grads = {q.grad.data_ptr() for q in model.parameters()}
    assert rec.calls and not any(t.data_ptr() in grads for _, args in rec.calls for t in args[0])


def _bases():
    out = []
    for name, cls, kw in [("fused SGD", torch.optim.SGD, {"momentum": 0.9}), ("fused AdamW", torch.optim.AdamW, {})]:
        try:
            cls([torch.nn.Parameter(torch.zeros(1))], lr=0.1, fused=True, **kw)
        except (RuntimeError, TypeError, ValueError) as exc:
            out.append(pytest.param(cls, kw, id=name, marks=pytest.mark.skip(reason=f"no CPU {name} here: {exc}")))
        else:
            out.append(pytest.param(cls, kw, id=name))
    return out


def _state(base):
    return {id(q): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for q, s in base.state.items()}


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) if torch.is_tensor(a[k][n])
                                           else a[k][n] == b[k][n] for n in a[k]) for k in a)


@pytest.mark.parametrize("base, base_kw", _bases())
def test_a_skipped_step_leaves_a_fused_bases_state_as_it_was(base, base_kw):
    """Steps 1 and 2 get a non-finite h_t: the first is decided on the host, the second on the
    device, where the base has no state yet (its first step would make fused SGD's momentum
    with empty_like). With uninitialised memory filled with NaN, neither leaves a trace in the
    base's state, and the steps that follow train to finite weights."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        model = make_model()
        opt = VASSO(model.parameters(), base, lr=0.05, rho=0.2, fused=True, **base_kw)
        for t, (x, y) in enumerate(make_batches(5)):
            before = _state(opt.base_optimizer)
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            assert opt.perturb()
            model.zero_grad()
            with opt.second_pass(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                (loss * (math.inf if t < 2 else 1.0)).backward()
            with pytest.warns(RuntimeWarning, match="non-finite") if t < 2 else _nothing():
                opt.descend()
                assert opt.nonfinite_steps == min(t + 1, 2)
            if t < 2:
                assert _same(_state(opt.base_optimizer), before), t
        assert t == 4 and opt._lists.flat_slope is not None  # the device path took the later steps
        assert all(torch.isfinite(q).all() for q in model.parameters())
        assert all(torch.isfinite(v).all() for s in opt.base_optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v))
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(deterministic)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class FakeHostCopy:
    """A stand-in for :class:`plugins.ondevice.HostCopy` on the CPU: the copy lands at once."""

    made = 0

    def __init__(self, like):
        type(self).made += 1
        self.host = torch.empty((), dtype=like.dtype)

    def start(self, verdict):
        self.host.copy_(verdict)

    def arrived(self):
        return True

    def wait(self):
        pass


def test_the_verdicts_reuse_their_host_slots(monkeypatch):
    if any(p.marks for p in _bases()[:1]):
        pytest.skip("no CPU fused SGD in this torch: every verdict is read on the host")
    monkeypatch.setattr(ondevice, "HostCopy", FakeHostCopy)
    monkeypatch.setattr(ondevice.Verdicts, "travels", staticmethod(lambda verdict: True))
    FakeHostCopy.made = 0
    model, opt = warm("VASSO", base=torch.optim.SGD, fused=True)  # a fused base: the verdicts travel
    for x, y in make_batches(6, seed=3):
        opt.step(closure_for(opt, model, x, y))
    assert opt.nonfinite_steps == 0
    assert FakeHostCopy.made == 1  # one slot, reused by every step after the first's arrival
    assert copy.deepcopy(opt)._verdicts._free == []


@pytest.mark.two_gpus  # on one GPU: reported as not run, with the reason (tests/helpers/gpu_marker.py)
@comparing(WITHIN_TOLERANCE)
def test_a_model_split_over_two_gpus_steps_as_on_one():
    results = []
    for devices in (("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")):
        torch.manual_seed(0)
        first, second = torch.nn.Linear(6, 16).to(devices[0]), torch.nn.Linear(16, 3).to(devices[1])
        params = list(first.parameters()) + list(second.parameters())
        opt = SAM(params, torch.optim.SGD, lr=0.05, rho=0.2, gsam_alpha=0.3)
        for x, y in make_batches(3):
            def closure():
                opt.zero_grad()
                out = second(torch.tanh(first(x.to(devices[0]))).to(devices[1]))
                loss = torch.nn.functional.cross_entropy(out, y.to(devices[1]))
                loss.backward()
                return loss
            opt.step(closure)
        results.append(torch.cat([q.detach().reshape(-1).cpu() for q in params]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("torch_has_the_check", [True, False])
def test_the_finiteness_check_finds_a_non_finite_element(torch_has_the_check, monkeypatch):
    if not torch_has_the_check:  # as on the CPU before torch 2.3: the fallback from the norms
        def missing(*args):
            raise NotImplementedError("_amp_foreach_non_finite_check_and_unscale_ on the CPU")
        monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    one = torch.ones(())
    for bad, expected in [(None, 0.0), (math.inf, 1.0), (-math.inf, 1.0), (math.nan, 1.0)]:
        tensors = [torch.ones(3), torch.zeros(2, 2)]
        if bad is not None:
            tensors[1][1, 0] = bad
        found_inf = torch.zeros(())
        ondevice.check_finite_(tensors, found_inf, one)
        assert found_inf.item() == expected, (bad, found_inf)
    found_inf = torch.ones(())  # a verdict already given stays
    ondevice.check_finite_([torch.ones(3)], found_inf, one)
    assert found_inf.item() == 1.0


class _TwoRanks:
    """A collective layout of two ranks: ``all_reduce`` adds this rank's terms to those the
    other rank sent (``other``), and keeps its own in ``sent``."""

    collective, device = True, torch.device("cpu")

    def __init__(self, other=None):
        self.other, self.sent = other, None

    def all_reduce(self, terms):
        self.sent = terms.clone()
        return terms if self.other is None else terms + self.other


@pytest.mark.parametrize("rank_b_counts", ["the float32 flat", "nothing"])
def test_ranks_that_sum_other_dtypes_agree_on_the_sums_dtype(rank_b_counts):
    """A model of float64 and float32 tensors sharded over mesh dimensions of its own each: a
    rank may sum only the float32 ones, or none.  Its ||v_t|| and <v_t, v_{t-1}> come back
    in float64 as on the rank that sums both, the same values: in float32 its ascent would
    be rounded otherwise, and the replicas would drift apart."""
    g = torch.Generator().manual_seed(0)
    f64, f32 = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(5, generator=g)
    old64, old32 = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(5, generator=g)
    flats = [f64, f32]  # every rank holds both flat buffers
    a = _TwoRanks()
    device_step._global_sums([[f64, f32]], [f64, f32], [old64, old32], a, flats)  # what rank A sends
    if rank_b_counts == "nothing":
        b_parts, b_old = [], []
    else:  # rank B's copy of f32 (another shard of it, in a real model)
        b_parts, b_old = [f32 * 2], [old32 * 2]
    b = _TwoRanks(other=a.sent)
    on_b = device_step._global_sums([b_parts], b_parts, b_old, b, flats)
    on_a = device_step._global_sums([[f64, f32]], [f64, f32], [old64, old32], _TwoRanks(other=b.sent), flats)
    assert [t.dtype for t in on_b] == [t.dtype for t in on_a] == [torch.float64, torch.float64]
    assert all(torch.equal(x, y) for x, y in zip(on_a, on_b))
    squares = f64.square().sum() + f32.double().square().sum() + sum(t.double().square().sum() for t in b_parts)
    assert on_b[0].item() == pytest.approx(squares.sqrt().item(), rel=1e-6)  # (f32 summed in float32)
