"""``--ddp-backend fully_sharded`` with ``--optimizer vasso``, what runs on a CPU: the
checkpoint path through fairscale's real FSDP on 2 gloo ranks (its optimizer-state
consolidation and resharding, which need no CUDA; its forward does).  The training runs
themselves need CUDA: test_fairseq_sharding.py's GPU tests."""

import math

import pytest

pytest.importorskip("fairseq.options", reason="fairseq is not installed")
pytest.importorskip("fairscale", reason="fairscale is not importable: pip install 'vasso-plugins[sharding]'")

from spawn_helpers import run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(2, "flat_cases:fairseq_checkpoint", timeout=300)


def test_fully_sharded_checkpoint_consolidates_and_resumes_bit_for_bit(ranks):
    """fairscale's gather_full_optim_state_dict refuses the core's per-entry counters (a dict:
    'unhashable'); the adapter's state dict leaves them to the top-level 'sharpness', so rank 0
    gathers one entry per model parameter, unflattened and unpadded (d_t beside Adam's
    moments), and each rank's shard of it loads into a new optimizer that then takes the
    same step as the running one, bit for bit."""
    for rank in ranks:
        assert rank["model_gathers"] is True
        assert rank["state after load"] and all(same for _, same in rank["state after load"])
        assert {k for k, _ in rank["state after load"]} == {"step", "exp_avg", "exp_avg_sq", "sam_slope"}
        ran, loaded = rank["counters"]
        assert ran["step"] == 3 and repr(ran) == repr(loaded)
        assert rank["next step equal"]
        ran, loaded = rank["diagnostics"]
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(ran.values(), loaded.values()))
    assert "unhashable" in ranks[0]["core's state dict"]  # rank 0 consolidates
    assert [r["shard sizes"] for r in ranks] == [[27], [27]]  # 53 elements: 27 + 26 and one padding zero
    saved = ranks[0]["saved"]
    # the whole model's parameters (Linear(6, 5), Linear(5, 3)), as an unsharded run saves them
    assert [saved[i]["sam_slope"] for i in sorted(saved)] == [(5, 6), (5,), (3, 5), (3,)]
    assert all(saved[i]["exp_avg"] == saved[i]["sam_slope"] and "sam_counters" not in saved[i] for i in saved)
    assert ranks[0]["saved sharpness"]["step"] == 3


_ARGV = ["/nonexistent-data", "--task", "translation", "--arch", "transformer", "--source-lang", "de",
         "--target-lang", "en", "--ddp-backend", "fully_sharded"]


def _parse(argv):
    """The command line as fairseq-train parses it, with the plugin's checks: the parsed
    optimizer, or the exit status and the last line on stderr."""
    from fairseq import options

    import fairseq_vasso  # noqa: F401  (as --user-dir imports it)

    try:
        out = options.parse_args_and_arch(options.get_training_parser(), argv)
    except SystemExit as exc:
        return exc.code
    return (out[0] if isinstance(out, tuple) else out).optimizer


@pytest.mark.parametrize("optimizer", ["sam", "vasso"])
def test_fully_sharded_is_let_through_where_cuda_is_and_adaptive_refused(optimizer, monkeypatch, capsys):
    """Where CUDA is (faked here), fully_sharded passes the checks, as stock adam's does;
    --adaptive and --cpu-offload are refused under it with the reason; --cpu, or no CUDA, refuses it with the
    reason and the alternatives."""
    import torch

    argv = _ARGV + ["--optimizer", optimizer]
    assert _parse(argv) == 2  # this machine: no CUDA
    assert "computes on CUDA" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _parse(argv) == optimizer
    assert _parse(argv + ["--adaptive"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--optimizer {optimizer} does not support --adaptive with --ddp-backend fully_sharded" in last, last
    assert "flat parameters" in last and "--zero-sharding os" in last, last
    assert _parse(argv + ["--cpu-offload", "--fp16"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--optimizer {optimizer} does not support --cpu-offload" in last and "NCCL" in last, last
    assert _parse(argv + ["--cpu"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "computes on CUDA" in last and "--zero-sharding os" in last and "c10d" in last, last
