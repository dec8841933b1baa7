"""The Slurm launcher's pure parts: parameters, command parsing, the status rules (no Slurm)."""

import json
import os

import pytest

from domainbed_vasso import slurm


def test_parameters_defaults_and_override():
    assert slurm.parameters("") == slurm.DEFAULTS
    params = slurm.parameters('{"slurm_partition": "gpu", "gpus_per_node": 1, "cpus_per_task": 8}')
    assert params["slurm_partition"] == "gpu" and params["cpus_per_task"] == 8
    assert params["slurm_array_parallelism"] == slurm.DEFAULTS["slurm_array_parallelism"]


@pytest.mark.parametrize("value, message", [("{oops", "is not valid JSON"),
                                            ('"gpu"', "must be a JSON object")])
def test_bad_parameters_name_the_variable(value, message):
    with pytest.raises(slurm.SlurmLauncherError, match=message) as info:
        slurm.parameters(value)
    assert slurm.ENV_SLURM in str(info.value)


def test_command_args_and_output_dir():
    cmd = ("/usr/bin/python -m domainbed_vasso.train --algorithm VASSO --dataset Debug28 "
           "--hparams '{\"batch_size\": 8}' --output_dir /s/abc --test_envs 0 2")
    args = slurm.command_args(cmd)
    assert args["test_envs"] == "0 2" and args["hparams"] == '{"batch_size": 8}'
    assert slurm.command_output_dir(cmd) == "/s/abc"
    with pytest.raises(slurm.SlurmLauncherError, match="without --output_dir"):
        slurm.command_output_dir("python -m domainbed_vasso.train --dataset X")


def test_slurm_state_of_array_tasks():
    states = {"7_0": "RUNNING", "7_1": "PENDING", "8_[2-5%2]": "PENDING", "9_0": "COMPLETED"}
    assert slurm.slurm_state("7_0", states) == "running"
    assert slurm.slurm_state("7_1", states) == "queued"
    assert slurm.slurm_state("8_3", states) == "queued"
    assert slurm.slurm_state("9_0", states) is None       # ended
    assert slurm.slurm_state("10_0", states) is None      # gone from the queue


def test_status_rules(tmp_path):
    sweep = tmp_path / "sweep"
    (sweep / "slurm").mkdir(parents=True)
    entries = []
    for i, name in enumerate(["a", "b", "c", "d"]):
        (sweep / name).mkdir()
        entries.append({"output_dir": str(sweep / name), "job_id": f"5_{i}",
                        "log_out": str(sweep / "slurm" / f"5_{i}_0_log.out"),
                        "log_err": str(sweep / "slurm" / f"5_{i}_0_log.err"),
                        "command": f"python -m domainbed_vasso.train --dataset Debug28 --algorithm ERM "
                                   f"--test_envs {i} --hparams_seed 0 --trial_seed 0 --output_dir {sweep / name}"})
    (sweep / "slurm" / "jobs.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    (sweep / "a" / "done").write_text("done")
    (sweep / "unrecorded").mkdir()
    rows = {os.path.basename(r["output_dir"]): r
            for r in slurm.sweep_status(sweep, states={"5_1": "PENDING", "5_2": "RUNNING"})}
    assert {k: r["state"] for k, r in rows.items()} == {
        "a": "done", "b": "queued", "c": "running", "d": "failed", "unrecorded": "incomplete"}
    assert rows["d"]["log"].endswith("5_3_0_log.err") and "without writing 'done'" in rows["d"]["reason"]
    text = slurm.format_status(list(rows.values()))
    assert "5 jobs: 1 done, 1 running, 1 queued, 1 failed, 1 incomplete" in text
    assert "Debug28 ERM test_envs=[3]" in text
