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
    assert [os.path.basename(p) for p in rows["d"]["logs"]] == ["5_3_0_log.out", "5_3_0_log.err"]
    assert "without writing 'done'" in rows["d"]["reason"]
    text = slurm.format_status(list(rows.values()))
    assert f"log: {rows['d']['logs'][0]}" in text and f"log: {rows['d']['logs'][1]}" in text
    assert "5 jobs: 1 done, 1 running, 1 queued, 1 failed, 1 incomplete" in text
    assert "Debug28 ERM test_envs=[3]" in text


def test_submit_splits_at_max_array_size_and_records_each_job(tmp_path, monkeypatch):
    calls = []

    class Paths:
        def __init__(self, job_id):
            self.stdout = tmp_path / f"{job_id}_0_log.out"
            self.stderr = tmp_path / f"{job_id}_0_log.err"

    class Job:
        def __init__(self, job_id):
            self.job_id, self.paths = job_id, Paths(job_id)

    class Executor:
        def map_array(self, fn, commands):
            calls.append(list(commands))
            array = 100 + len(calls)
            return [Job(f"{array}_{i}") for i in range(len(commands))]

    monkeypatch.setattr(slurm, "make_executor", lambda folder, params: Executor())
    sweep = tmp_path / "sweep"
    commands = [f"python -m domainbed_vasso.train --output_dir {sweep / str(i)}" for i in range(5)]
    jobs = slurm.submit(str(sweep), commands, dict(slurm.DEFAULTS), array_limit=2)
    assert [len(c) for c in calls] == [2, 2, 1] and sum(calls, []) == commands
    record = slurm.read_record(str(sweep))
    assert [record[str(sweep / str(i))]["job_id"] for i in range(5)] == \
        ["101_0", "101_1", "102_0", "102_1", "103_0"] == [j.job_id for j in jobs]
