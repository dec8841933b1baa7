"""``--ddp-backend fully_sharded`` with ``--optimizer sam|vasso``: the flag checks where CUDA
is (faked here).  The training runs are test_fairseq_sharding.py's (on 2 gloo ranks with
fairscale's FSDP given the CPU, and on GPUs)."""

import pytest

pytest.importorskip("fairseq.options", reason="fairseq is not installed")


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
    """Where CUDA is (faked here where there is none), fully_sharded passes the checks, as
    stock adam's does; --adaptive and --cpu-offload are refused under it with the reason;
    --cpu, or no CUDA (faked where there is some), refuses it with the reason and the alternatives."""
    import torch

    argv = _ARGV + ["--optimizer", optimizer]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _parse(argv) == 2  # no CUDA
    assert "computes on CUDA" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _parse(argv) == 2  # one process, saving: stock fairscale fails at the first save
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--ddp-backend fully_sharded on one process (--distributed-world-size 1)" in last, last
    assert "_full_param_padded" in last and "--use-sharded-state" in last and "legacy_ddp" in last, last
    for one_process in (["--use-sharded-state"], ["--no-save"]):
        assert _parse(argv + ["--distributed-world-size", "1"] + one_process) == optimizer
    argv += ["--distributed-world-size", "2"]
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
