"""Slices of flat parameters that the model gathers itself (fairscale's FSDP, fairseq's
``--ddp-backend fully_sharded``; torch's FSDP1 without ``use_orig_params``, run here too):
``PartitionGroup(group, model_gathers=True)`` gives the one-process step for every member
of plain geometry, on 2 and 4 gloo ranks, with the padding left at zero; adaptive
geometry and wrong splits are refused.

One spawn per world size (flat_cases.every_member) runs every case; fairscale's FSDP
itself needs CUDA, so the loop does what it does by hand (see flat_cases)."""

import math

import pytest

from spawn_helpers import run_ranks


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def results(request):
    return request.param, run_ranks(request.param, "flat_cases:every_member", timeout=300)


def cases(rank):
    """The hand-made shards' cases."""
    return {k: v for k, v in rank.items() if isinstance(k, str) and k not in ("padding", "wrong use",
                                                                               "torch FSDP1 shards")}


def fsdp1(rank):
    return {k[1]: v for k, v in rank.items() if isinstance(k, tuple)}


def test_every_plain_member_gives_the_one_process_step_on_flat_shards(results):
    world, ranks = results
    # the two flat vectors (35 and 18 elements) split as torch.chunk splits them, zero-padded at the end
    pads = [r["padding"] for r in ranks]
    assert pads == ([[0, 0], [1, 0]] if world == 2 else [[0, 0], [0, 0], [0, 0], [1, 2]])
    members = cases(ranks[0])
    assert set(members) == {"SAM", "GSAM", "eSAM", "VASSO", "eVASSO", "V+G"}
    assert {api for api, *_ in members.values()} == {"closure", "explicit", "first_step"}
    for rank in ranks:
        for kind, (api, error, _, _, padding) in cases(rank).items():
            assert error <= 1e-5, (kind, api, error)
            assert padding == 0.0, (kind, api, padding)  # the shards' and the buffers' padding


def _same(a, b):
    return a == b or (math.isnan(a) and math.isnan(b))


def test_the_diagnostics_are_global_on_flat_shards(results):
    """The same on every rank, bit for bit, and the one-process values (the two-pass
    fraction of eSAM / eVASSO included: the coin is the same)."""
    world, ranks = results
    for kind, (api, _, diags, ref, _) in cases(ranks[0]).items():
        for other in ranks[1:]:
            assert all(_same(a[k], b[k]) for a, b in zip(diags, cases(other)[kind][2]) for k in a), kind
        for t, (got, want) in enumerate(zip(diags, ref)):
            for k in want:
                if math.isnan(want[k]):
                    assert math.isnan(got[k]), (kind, api, t, k)
                else:
                    assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (kind, api, t, k, got[k], want[k])
    assert any(d["two_pass"] == 0.0 for d in cases(ranks[0])["eSAM"][2])  # the coin did skip


def test_wrong_use_of_model_gathers_is_refused(results):
    world, ranks = results
    for rank in ranks:
        refused = rank["wrong use"]
        for kind in ("ASAM", "adaptive eVASSO"):
            assert refused[kind] and "adaptive" in refused[kind] and "model_gathers" in refused[kind], kind
        assert "model_gathers must be True or False" in refused["model_gathers='yes'"]
        assert refused["pickled"] == (True, list(range(world)), True)
        assert refused["replicas"] and "replicas" in refused["replicas"]
        split = refused["ZeRO-like split"]
        assert split and "not the equal-length shards" in split and "drop model_gathers" in split


def test_torch_fsdp1_flat_shards_give_the_one_process_step(results):
    """torch's own FSDP1 with use_orig_params=False on the CPU (one flat vector of 53 elements,
    padded on the last rank): every plain member, each API, to 1e-5, and the reference's
    diagnostics on every rank."""
    world, ranks = results
    if not fsdp1(ranks[0]):
        pytest.skip("torch's FSDP1 runs on CPUs from torch 2.6 on (as FSDP2's tests here)")
    assert [r["torch FSDP1 shards"] for r in ranks] == [[math.ceil(53 / world)]] * world
    for rank in ranks:
        members = fsdp1(rank)
        assert set(members) == set(cases(rank))
        for kind, (api, error, diags, ref) in members.items():
            assert error <= 1e-5, (kind, api, error)
            for t, (got, want) in enumerate(zip(diags, ref)):
                for k in want:
                    assert _same(got[k], want[k]) or got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (
                        kind, api, t, k, got[k], want[k])
