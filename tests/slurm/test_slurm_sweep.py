"""DomainBed sweeps through ``--command_launcher slurm`` on a real (local, single-node)
Slurm: to completion, interrupted and resumed, and with a job that fails."""

import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import process_group
import pytest
from ports import free_port

PY = sys.executable
# Debug28: 3 environments, 13 training examples each (DomainBed's loader hangs on a batch above 13)
HPARAMS = json.dumps({"batch_size": 8})
STEPS = "3"
WAIT_S = 900


def run(args, env, **extra):
    e = dict(env)
    e.update(extra)
    return process_group.run(args, env=e, capture_output=True, text=True, timeout=600)  # in the test's tmp_path


def sweep(command, out, env, *flags, **extra_env):
    args = [PY, "-m", "domainbed_vasso.sweep", command, "--datasets", "Debug28", "--algorithms", "VASSO",
            "--n_hparams", "1", "--n_trials", "1", "--steps", STEPS, "--command_launcher", "slurm",
            "--skip_confirmation", "--hparams", HPARAMS, "--data_dir", str(out.parent),
            "--output_dir", str(out), *flags]
    proc = run(args, env, **extra_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def record(out):
    path = out / "slurm" / "jobs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def squeue(env):
    proc = run(["squeue", "-h", "-r", "-o", "%i %T"], env)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split() for line in proc.stdout.splitlines() if line.strip())


def status(out, env):
    proc = run([PY, "-m", "domainbed_vasso.sweep", "status", "--output_dir", str(out)], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def status_rows(out, env):
    """{output_dir: (state, job id)} parsed from the status view."""
    rows = {}
    for line in status(out, env).splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] in ("queued", "running", "done", "failed", "incomplete"):
            rows[words[2]] = (words[0], words[1])
    return rows


def job_dirs(out):
    return sorted(str(p) for p in out.iterdir() if p.is_dir() and p.name != "slurm")


def wait_for(condition, env, what, out=None, timeout=WAIT_S):
    start = time.time()
    while not condition():
        if time.time() - start > timeout:
            detail = status(out, env) if out is not None else ""
            pytest.fail(f"timed out after {timeout}s waiting for {what}\n{detail}\n{squeue(env)}")
        time.sleep(1)


def done(path):
    return os.path.exists(os.path.join(path, "done"))


def scontrol(env, *args):
    proc = run(["scontrol", *args], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sweep_runs_to_completion_and_tables_read_it(slurm, tmp_path):
    env = slurm["env"]
    out = tmp_path / "sweep"
    log = sweep("launch", out, env)
    assert "About to launch 6 jobs" in log
    entries = record(out)
    assert len(entries) == 6
    array_ids = {e["job_id"].split("_")[0] for e in entries}
    assert len(array_ids) == 1, "one launch is one job array"
    assert f"submitted 6 jobs as Slurm job {array_ids.pop()}" in log
    dirs = job_dirs(out)
    assert sorted(e["output_dir"] for e in entries) == dirs
    wait_for(lambda: all(done(d) for d in dirs), env, "the 6 jobs' done files", out)
    # the children ran domainbed_vasso.train: VASSO's own diagnostics are in the results
    for d in dirs:
        last = json.loads(open(os.path.join(d, "results.jsonl")).read().splitlines()[-1])
        assert last["args"]["algorithm"] == "VASSO" and "sharpness" in last
    rows = status_rows(out, env)
    assert {s for s, _ in rows.values()} == {"done"} and len(rows) == 6
    for e in entries:  # submitit's logs, under <output_dir>/slurm/
        assert os.path.dirname(e["log_err"]) == str(out / "slurm") and os.path.exists(e["log_out"])
    # vasso-domainbed-tables, as python -m (the console script needs an installed package)
    tables = run([PY, "-m", "domainbed_vasso.tables", str(out), "--selection", "loo", "iid"], env)
    assert tables.returncode == 0, tables.stderr
    heading = "### Debug28, model selection: leave-one-domain-out cross-validation"
    assert heading in tables.stdout and "| Test domain | VASSO |" in tables.stdout
    loo = tables.stdout.split(heading)[1].split("###")[0]
    cells = [line.split("|")[2].strip() for line in loo.splitlines()
             if line.startswith("|") and not line.startswith("| Test domain") and "---" not in line]
    assert len(cells) == 4 and all(c not in ("", "-") for c in cells), loo  # 3 domains, Average


def test_interrupted_sweep_resumes_only_unfinished_jobs(slurm, tmp_path):
    env = slurm["env"]
    out = tmp_path / "sweep"
    held = json.dumps({"slurm_additional_parameters": {"hold": True}})

    def three(command, **extra_env):  # one job per test domain (a whole sweep has 6): each runs at most twice
        return sweep(command, out, env, "--single_test_envs", **extra_env)

    three("launch", DOMAINBED_VASSO_SLURM=held)
    first = record(out)
    assert len(first) == 3
    ids = [e["job_id"] for e in first]
    assert all(squeue(env).get(i) == "PENDING" for i in ids)
    assert {s for s, _ in status_rows(out, env).values()} == {"queued"}

    # a second launch while they are queued submits nothing new
    again = three("launch")
    assert "About to launch 0 jobs" in again and len(record(out)) == 3
    # nor when a queued job's folder is gone (stock delete_incomplete removes it):
    # the launcher sees its recorded Slurm job and leaves it queued
    victim = first[0]["output_dir"]
    os.rmdir(victim)
    again = three("launch")
    assert "About to launch 1 jobs" in again
    assert f"not resubmitting {victim}: its Slurm job {first[0]['job_id']} is queued" in again
    assert len(record(out)) == 3 and len(squeue(env)) == 3
    # delete_incomplete keeps the folders of queued jobs
    deleted = three("delete_incomplete")
    assert deleted.count("keeping ") == 3
    assert job_dirs(out) == sorted(e["output_dir"] for e in first)

    # one finishes, then the sweep is interrupted: the other two are cancelled
    finished, interrupted = first[:1], first[1:]
    scontrol(env, "release", ",".join(e["job_id"] for e in finished))
    wait_for(lambda: all(done(e["output_dir"]) for e in finished), env, "the released job", out)
    proc = run(["scancel", *[e["job_id"] for e in interrupted]], env)
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: not any(e["job_id"] in squeue(env) for e in interrupted), env, "scancel")
    rows = status_rows(out, env)
    assert sorted(s for s, _ in rows.values()) == ["done"] + ["failed"] * 2
    before = {}
    for e in finished:
        path = os.path.join(e["output_dir"], "results.jsonl")
        before[path] = (open(path, "rb").read(), os.stat(path).st_mtime_ns)

    # DomainBed's own recipe: delete_incomplete, then launch
    deleted = three("delete_incomplete")
    assert "About to delete 2 jobs" in deleted and "keeping " not in deleted
    assert not any(os.path.exists(e["output_dir"]) for e in interrupted)
    relaunch = three("launch")
    assert "About to launch 2 jobs" in relaunch
    second = record(out)[3:]
    assert sorted(e["output_dir"] for e in second) == sorted(e["output_dir"] for e in interrupted)
    assert len({e["job_id"].split("_")[0] for e in second}) == 1
    wait_for(lambda: all(done(e["output_dir"]) for e in first), env, "the relaunched jobs", out)
    for path, (data, mtime) in before.items():
        assert open(path, "rb").read() == data and os.stat(path).st_mtime_ns == mtime, path
    rows = status_rows(out, env)
    assert {s for s, _ in rows.values()} == {"done"} and len(rows) == 3
    assert {rows[e["output_dir"]][1] for e in second} == {e["job_id"] for e in second}


def test_failing_job_shows_failed_with_its_log(slurm, tmp_path):
    env = slurm["env"]
    out = tmp_path / "sweep"
    held = json.dumps({"slurm_additional_parameters": {"hold": True}})
    sweep("launch", out, env, "--single_test_envs", DOMAINBED_VASSO_SLURM=held)
    entries = record(out)
    assert len(entries) == 3
    broken, fine = entries[0], entries[1:]
    # the job's folder exists (DomainBed made it); make its first results.jsonl write fail
    os.mkdir(os.path.join(broken["output_dir"], "results.jsonl"))
    scontrol(env, "release", broken["job_id"].split("_")[0])
    ids = [e["job_id"] for e in entries]
    wait_for(lambda: not any(i in squeue(env) for i in ids), env, "the 3 jobs to end", out)
    assert all(done(e["output_dir"]) for e in fine)
    assert not done(broken["output_dir"])
    view = status(out, env)
    rows = status_rows(out, env)
    assert rows[broken["output_dir"]] == ("failed", broken["job_id"])
    assert all(rows[e["output_dir"]][0] == "done" for e in fine)
    assert f"log: {broken['log_out']}" in view and f"log: {broken['log_err']}" in view
    # DomainBed's train tees its stderr into its stdout: its traceback is in the .out log
    # (and the job's err.txt), submitit's verdict in the .err log and in the view
    assert "IsADirectoryError" in open(broken["log_out"]).read()
    assert "IsADirectoryError" in open(os.path.join(broken["output_dir"], "err.txt")).read()
    assert "RuntimeError: the job's command exited with status 1" in open(broken["log_err"]).read()
    assert "RuntimeError: the job's command exited with status 1" in view.split(broken["output_dir"])[1]
    # nothing else lost: the failed job's own output and the others' results stay
    assert os.path.exists(os.path.join(broken["output_dir"], "out.txt"))
    for e in fine:
        assert os.path.getsize(os.path.join(e["output_dir"], "results.jsonl")) > 0


def test_bad_parameters_or_no_slurm_stop_before_any_folder(slurm, tmp_path):
    env = slurm["env"]
    out = tmp_path / "sweep"
    args = [PY, "-m", "domainbed_vasso.sweep", "launch", "--datasets", "Debug28", "--algorithms", "ERM",
            "--n_hparams", "1", "--n_trials", "1", "--command_launcher", "slurm", "--skip_confirmation",
            "--data_dir", str(tmp_path), "--output_dir", str(out)]
    no_slurm = dict(env, PATH=os.path.dirname(PY) + os.pathsep + "/nonexistent")
    # the local Slurm's configuration, its controller moved to a port where nothing listens: a
    # controller that is down (squeue gives up after ~10 s)
    with open(slurm["conf"]) as f:
        conf, moved = re.subn(r"^SlurmctldPort=\d+$", f"SlurmctldPort={free_port()}", f.read(), flags=re.M)
    assert moved == 1, conf
    down = tmp_path / "down.conf"
    down.write_text(conf)
    missing = tmp_path / "missing.conf"
    # five launches refused before any folder, side by side (each is a Python that imports torch
    # and DomainBed: seconds apiece, all spent before the refusal)
    refusals = [(env, {"DOMAINBED_VASSO_SLURM": "{not json"}, "DOMAINBED_VASSO_SLURM is not valid JSON"),
                (env, {"DOMAINBED_VASSO_SLURM": '{"slurm_partion": "gpu"}'}, "submitit rejects these parameters"),
                (no_slurm, {}, "needs Slurm's sbatch, srun, squeue on PATH"),
                (env, {"SLURM_CONF": str(missing)}, f"SLURM_CONF={missing} is not a file"),
                (env, {"SLURM_CONF": str(down)}, "Slurm does not answer")]
    with ThreadPoolExecutor(max_workers=len(refusals)) as pool:
        procs = list(pool.map(lambda case: run(args, case[0], **case[1]), refusals))
    for (_, _, message), proc in zip(refusals, procs):
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not out.exists()
    # what only sbatch can refuse comes after DomainBed made the folders: the error says so
    proc = run(args + ["--single_test_envs"], env, DOMAINBED_VASSO_SLURM='{"slurm_partition": "nosuch"}')
    assert proc.returncode == 2 and "submitting 3 jobs failed" in proc.stderr, proc.stderr
    assert "invalid partition" in proc.stderr.lower() and "delete_incomplete" in proc.stderr
    assert len(job_dirs(out)) == 3 and not (out / "slurm" / "jobs.jsonl").exists()
