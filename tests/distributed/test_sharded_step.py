"""The one-process step under DDP, FSDP2 (uneven shards, an empty shard, reshard after
forward or not, a 2-D replicate x shard mesh), ZeroRedundancyOptimizer and fairscale's
OSS, for every member of the family, on 1, 2 and 4 gloo ranks (issue 24).

One spawn per world size runs every case (dist_cases.every_setting); each rank trains
the one-process reference on the whole batch beside the distributed run on its slice."""

import math

import pytest
import torch

from spawn_helpers import run_ranks

pytest.importorskip("torch.distributed.fsdp")
if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)
pytest.importorskip("fairscale")

WORLDS = [1, 2, 4]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda n: f"{n}ranks")
def results(request):
    return request.param, run_ranks(request.param, "dist_cases:every_setting", timeout=300)


def test_every_member_gives_the_one_process_step_in_every_setting(results):
    world, ranks = results
    settings = {s for s, _ in ranks[0]}
    expected = {"DDP", "FSDP2 reshard=True", "FSDP2 reshard=False", "ZeRO", "OSS"} | (
        {"HSDP 2-D"} if world % 2 == 0 else set())
    assert settings == expected
    worst = {key: max(r[key][0] for r in ranks) for key in ranks[0]}
    assert max(worst.values()) <= 1e-5, {k: v for k, v in worst.items() if v > 1e-5}
