"""The one-process step under DDP, FSDP2 (uneven shards, an empty shard, reshard after
forward or not, a 2-D replicate x shard mesh, tensor parallelism x FSDP2),
ZeroRedundancyOptimizer and fairscale's OSS, for every member of the family, on 1, 2 and 4 gloo ranks.

One spawn per world size runs every case (dist_cases.every_setting); each rank trains
the one-process reference on the whole batch beside the distributed run on its slice."""

import math

import pytest
import torch

from spawn_helpers import run_ranks

FSDP = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(FSDP, "fully_shard"):
    pytest.skip(f"FSDP2 (torch.distributed.fsdp.fully_shard) needs torch >= 2.6, this is {torch.__version__}",
                allow_module_level=True)
pytest.importorskip("fairscale")


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"{n}ranks")
def results(request):
    return request.param, run_ranks(request.param, "dist_cases:every_setting", timeout=300)


def cases(rank):
    return {k: v for k, v in rank.items() if isinstance(k, tuple)}


def test_every_member_gives_the_one_process_step_in_every_setting(results):
    world, ranks = results
    # uneven shards (5 and 3 rows), and on 4 ranks one rank holds none of them
    rows = [r["local sizes"] for r in ranks]
    assert [sum(col) for col in zip(*rows)] == [5, 5, 3, 3]
    if world == 4:
        assert rows[3] == [0, 0, 0, 0] and rows[0] == [2, 2, 1, 1]
    ranks = [cases(r) for r in ranks]
    settings = {s for s, _ in ranks[0]}
    expected = {"DDP", "FSDP2 reshard=True", "FSDP2 reshard=False", "ZeRO", "OSS"} | (
        {"HSDP 2-D"} if world % 2 == 0 else set()) | ({"TP x FSDP2"} if world == 4 else set())
    assert settings == expected
    assert len(ranks[0]) == len(expected) * 8  # every member in every setting
    worst = {key: max(r[key][0] for r in ranks) for key in ranks[0]}
    assert max(worst.values()) <= 1e-5, {k: v for k, v in worst.items() if v > 1e-5}


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def test_the_diagnostics_are_global(results):
    """sharpness, stability, ascent_norm and loss_gap: the same on every rank, bit for bit,
    and the one-process values (loss_gap: the mean of the ranks' gaps, as DDP's loss is
    the mean of theirs; the explicit API leaves it to the host: NaN on both sides)."""
    world, ranks = results
    ranks = [cases(r) for r in ranks]
    for key, (_, diags, ref) in ranks[0].items():
        for other in ranks[1:]:
            assert all(_same(a[k], b[k]) for a, b in zip(diags, other[key][1]) for k in a), key
        for t, (got, want) in enumerate(zip(diags, ref)):
            for k in want:
                if math.isnan(want[k]):
                    assert math.isnan(got[k]), (key, t, k)
                else:
                    assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (key, t, k, got[k], want[k])
    # the loss gap really is a step's value there: a closure member has one
    assert any(not math.isnan(step["loss_gap"]) for _, d, _ in ranks[0].values() for step in d)


def test_hsdp_steps_are_decided_on_the_device(results):
    """HSDP shards every tensor on the same mesh dimension and replicates it on the other:
    each rank counts its whole shard, the sums run over the shard dimension alone, and the
    steps take the device path (its flat slope buffer), ASAM's geometry included."""
    world, ranks = results
    if world % 2:
        pytest.skip("HSDP needs an even number of ranks")
    from core_helpers import VARIANTS

    for rank in ranks:
        on_device = rank["HSDP on the device"]
        assert set(on_device) == set(VARIANTS) and all(on_device.values()), on_device


def test_tensor_parallel_steps_are_decided_on_the_device(results):
    """Tensor parallelism beside FSDP2 shards the last bias on the data-parallel dimension
    alone: each tensor-parallel pair holds it twice and sums it once (the first of the pair),
    the others on both mesh dimensions; those steps take the device path too, ASAM's
    geometry included, and still give the one-process step (the test above): after the
    first, each step over SGD reads the host once (the base's verdict)."""
    world, ranks = results
    if world != 4:
        pytest.skip("tensor parallelism x FSDP2 runs on a 2 x 2 mesh")
    from core_helpers import VARIANTS

    for rank in ranks:
        on_device = rank["TP x FSDP2 on the device"]
        assert set(on_device) == set(VARIANTS) and all(on_device.values()), on_device
        reads = rank["TP x FSDP2 reads"]
        assert all(counts and set(counts) == {1} for counts in reads.values()), reads
