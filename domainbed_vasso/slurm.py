"""``--command_launcher slurm``: DomainBed sweeps as Slurm job arrays, through submitit.

    export DOMAINBED_VASSO_SLURM='{"slurm_partition": "gpu", "gpus_per_node": 1,
                                   "cpus_per_task": 8, "timeout_min": 240}'
    python -m domainbed_vasso.sweep launch ... --command_launcher slurm   # submits, returns
    python -m domainbed_vasso.sweep status --output_dir sweep/            # queued/running/done/failed
    python -m domainbed_vasso.sweep delete_incomplete ...                 # keeps queued/running jobs

One ``launch`` submits one Slurm job array (``slurm_array_parallelism`` of its tasks at
most run at once); each task runs one job's command, ``<python> -m
domainbed_vasso.train ...``. submitit's files (sbatch script, pickles, logs
``<job id>_0_log.out``/``.err``) and ``jobs.jsonl``, one line per submitted job
(output folder, Slurm job id, log paths), go to ``<sweep output_dir>/slurm/``.

DomainBed judges a job from its output folder alone (``done`` file: done; folder:
incomplete; none: not launched), so a queued job looks incomplete to it. From the
record and ``squeue`` this module knows better: the launcher submits no job whose
recorded Slurm job is still queued or running, ``delete_incomplete`` (through
``domainbed_vasso.sweep``) keeps such a job's folder, and ``status`` shows each job's
state with its log. docs/domainbed.md has the whole workflow.
"""

import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys

ENV_SLURM = "DOMAINBED_VASSO_SLURM"

#: submitit parameters used unless ``DOMAINBED_VASSO_SLURM`` sets them (it is merged over these).
DEFAULTS = {
    "name": "domainbed_vasso",
    "timeout_min": 720,            # one 5,000-step ResNet-50 run on one GPU needs a few hours
    "nodes": 1,
    "tasks_per_node": 1,           # DomainBed's train script is one process
    "cpus_per_task": 1,
    "slurm_array_parallelism": 64,  # Slurm's array throttle: tasks running at once
}

RECORD = "jobs.jsonl"
SLURM_SUBDIR = "slurm"
QUEUED, RUNNING, DONE, FAILED, INCOMPLETE = "queued", "running", "done", "failed", "incomplete"

# squeue's states of a job that may still run (everything else has ended)
_QUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD",
                  "SPECIAL_EXIT", "SUSPENDED", "STOPPED", "REVOKED"}
_RUNNING_STATES = {"RUNNING", "CONFIGURING", "COMPLETING", "RESIZING", "SIGNALING", "STAGE_OUT"}


class SlurmLauncherError(RuntimeError):
    """The Slurm launcher cannot submit (no Slurm, bad ``DOMAINBED_VASSO_SLURM``)."""


# --- parameters and Slurm -----------------------------------------------------------------

def parameters(value=None):
    """The submitit parameters: :data:`DEFAULTS` updated with ``DOMAINBED_VASSO_SLURM``."""
    if value is None:
        value = os.environ.get(ENV_SLURM, "")
    params = dict(DEFAULTS)
    if value.strip():
        try:
            given = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SlurmLauncherError(f"{ENV_SLURM} is not valid JSON ({exc}): {value!r}; expected an "
                                     "object of submitit parameters, e.g. "
                                     "'{\"slurm_partition\": \"gpu\", \"gpus_per_node\": 1}'") from None
        if not isinstance(given, dict):
            raise SlurmLauncherError(f"{ENV_SLURM} must be a JSON object of submitit parameters, "
                                     f"got {type(given).__name__}: {value!r}")
        params.update(given)
    return params


def check_slurm():
    """Raise :class:`SlurmLauncherError` unless ``sbatch``, ``srun`` and ``squeue`` exist and
    the controller answers."""
    missing = [c for c in ("sbatch", "srun", "squeue") if shutil.which(c) is None]
    if missing:
        raise SlurmLauncherError(f"--command_launcher slurm needs Slurm's {', '.join(missing)} on PATH "
                                 "(run the sweep on a Slurm login node)")
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # squeue would retry it for 60 s before saying so
        raise SlurmLauncherError(f"SLURM_CONF={conf} is not a file: point it at the cluster's slurm.conf, "
                                 "or unset it for Slurm's default")
    try:
        probe = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True,
                               timeout=60)
    except subprocess.TimeoutExpired:
        raise SlurmLauncherError("squeue did not answer within 60 s: is slurmctld up "
                                 f"(SLURM_CONF={os.environ.get('SLURM_CONF', 'unset')})?") from None
    if probe.returncode != 0:
        raise SlurmLauncherError(f"Slurm does not answer (squeue: {probe.stderr.strip() or probe.returncode}; "
                                 f"SLURM_CONF={os.environ.get('SLURM_CONF', 'unset')})")


def make_executor(folder, params):
    """A submitit Slurm executor with ``params``; their errors name ``DOMAINBED_VASSO_SLURM``."""
    import submitit
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    try:
        executor.update_parameters(**params)
    except (AssertionError, NameError, ValueError, TypeError) as exc:
        raise SlurmLauncherError(f"{ENV_SLURM}: submitit rejects these parameters: {exc}") from None
    return executor


def preflight(params=None):
    """Everything the launcher checks before a sweep makes any folder: parameters parse,
    submitit is installed, Slurm answers, submitit accepts the parameters."""
    params = parameters() if params is None else params
    try:
        import submitit  # noqa: F401
    except ImportError:
        raise SlurmLauncherError("--command_launcher slurm needs submitit: pip install submitit "
                                 "(or this project's [slurm] extra)") from None
    check_slurm()
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        make_executor(tmp, params)
    return params


def squeue_states():
    """``{job id: state}`` of every job Slurm lists, array tasks one by one (``12_3``)."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmLauncherError(f"cannot ask Slurm which jobs are queued or running (squeue: {exc})") from None
    if out.returncode != 0:
        raise SlurmLauncherError(f"squeue failed: {out.stderr.strip() or out.returncode}")
    states = {}
    for line in out.stdout.splitlines():
        if "|" in line:
            job_id, state = line.strip().split("|", 1)
            states[job_id] = state.strip()
    return states


def slurm_state(job_id, states):
    """queued / running for a recorded job Slurm still lists as such, else None."""
    state = states.get(job_id)
    if state is None and "_" in job_id:
        # a pending array whose tasks squeue -r has not split yet reads 12_[3-5]
        array_id = job_id.split("_", 1)[0]
        state = next((s for j, s in states.items() if j.startswith(array_id + "_[")), None)
    if state in _QUEUED_STATES:
        return QUEUED
    if state in _RUNNING_STATES:
        return RUNNING
    return None


# --- the record ---------------------------------------------------------------------------

def slurm_dir(sweep_dir):
    return os.path.join(sweep_dir, SLURM_SUBDIR)


def read_record(sweep_dir):
    """The latest submission of each job folder: ``{output_dir: entry}``."""
    path = os.path.join(slurm_dir(sweep_dir), RECORD)
    latest = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    entry = json.loads(line)
                    latest[os.path.abspath(entry["output_dir"])] = entry
    return latest


def active_jobs(sweep_dir, states=None):
    """``{output_dir: (job id, queued|running)}`` of the recorded jobs Slurm still holds."""
    record = read_record(sweep_dir)
    if not record:
        return {}
    states = squeue_states() if states is None else states
    active = {}
    for output_dir, entry in record.items():
        state = slurm_state(entry["job_id"], states)
        if state is not None:
            active[output_dir] = (entry["job_id"], state)
    return active


def command_args(command):
    """``{flag: value}`` of a train command (lists joined by spaces, as DomainBed wrote them)."""
    words = shlex.split(command)
    args, key = {}, None
    for word in words:
        if word.startswith("--"):
            key = word[2:]
            args[key] = []
        elif key is not None:
            args[key].append(word)
    return {k: " ".join(v) for k, v in args.items()}


def command_output_dir(command):
    output_dir = command_args(command).get("output_dir")
    if not output_dir:
        raise SlurmLauncherError(f"a sweep command without --output_dir: {command[:120]!r}")
    return os.path.abspath(output_dir)


# --- launching ----------------------------------------------------------------------------

def run_command(command):
    """One array task: run a job's shell command; a non-zero exit fails the Slurm task."""
    print(f"domainbed_vasso.slurm: {command}", flush=True)
    code = subprocess.call(command, shell=True)
    if code != 0:
        raise RuntimeError(f"the job's command exited with status {code}: {command}")
    return code


def slurm_launcher(commands):
    """DomainBed command launcher: submit ``commands`` as one Slurm job array and return."""
    params = parameters()
    check_slurm()
    by_sweep = {}
    for command in commands:
        by_sweep.setdefault(os.path.dirname(command_output_dir(command)), []).append(command)
    if not by_sweep:
        print("domainbed_vasso.slurm: nothing to submit")
    for sweep_dir, todo in by_sweep.items():
        active = active_jobs(sweep_dir)
        kept = [c for c in todo if command_output_dir(c) in active]
        for command in kept:
            job_id, state = active[command_output_dir(command)]
            print(f"domainbed_vasso.slurm: not resubmitting {command_output_dir(command)}: "
                  f"its Slurm job {job_id} is {state}")
        todo = [c for c in todo if c not in kept]
        if todo:
            submit(sweep_dir, todo, params)
        else:
            print("domainbed_vasso.slurm: nothing new to submit")


def max_array_size():
    """Slurm's ``MaxArraySize`` (array indices run 0 .. MaxArraySize - 1), or None if unknown."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def submit(sweep_dir, commands, params, array_limit=None):
    """Submit ``commands`` as one job array (several when they outnumber Slurm's
    ``MaxArraySize``); append them to the record as they are submitted; return the jobs."""
    folder = slurm_dir(sweep_dir)
    os.makedirs(folder, exist_ok=True)
    executor = make_executor(folder, params)
    array_limit = array_limit or max_array_size() or len(commands)
    chunks = [commands[i:i + array_limit] for i in range(0, len(commands), array_limit)]
    if len(chunks) > 1:
        print(f"domainbed_vasso.slurm: {len(commands)} jobs exceed Slurm's MaxArraySize={array_limit}: "
              f"{len(chunks)} job arrays, each with its own throttle")
    throttle = int(params.get("slurm_array_parallelism", 256))
    all_jobs = []
    for chunk in chunks:
        try:
            jobs = executor.map_array(run_command, chunk)
        except Exception as exc:  # sbatch refused (partition, account, limits, ...)
            raise SlurmLauncherError(
                f"submitting {len(chunk)} jobs failed: {exc}\n{len(all_jobs)} of {len(commands)} jobs were "
                "submitted before (see `python -m domainbed_vasso.sweep status`); the job folders "
                "DomainBed made for the others are empty: run delete_incomplete, fix "
                f"{ENV_SLURM}, and launch again") from exc
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(os.path.join(folder, RECORD), "a") as f:
            for command, job in zip(chunk, jobs):
                f.write(json.dumps({
                    "output_dir": command_output_dir(command), "job_id": str(job.job_id),
                    "log_out": str(job.paths.stdout), "log_err": str(job.paths.stderr),
                    "submitted": now, "command": command}) + "\n")
        array_id = str(jobs[0].job_id).split("_")[0]
        print(f"domainbed_vasso.slurm: submitted {len(jobs)} jobs as Slurm job {array_id} "
              f"(at most {min(len(jobs), throttle)} at once); logs and job ids under {folder}")
        all_jobs += jobs
    return all_jobs


def register_launcher():
    """Add ``slurm`` to DomainBed's ``command_launchers.REGISTRY``; idempotent."""
    from domainbed import command_launchers
    current = command_launchers.REGISTRY.get("slurm")
    if current is not slurm_launcher and not getattr(current, "_domainbed_vasso_slurm", False):
        command_launchers.REGISTRY["slurm"] = slurm_launcher


slurm_launcher._domainbed_vasso_slurm = True


# --- delete_incomplete guard --------------------------------------------------------------

class keep_active_folders:
    """While active, ``shutil.rmtree`` (what DomainBed's ``Job.delete`` calls) leaves the
    folders of recorded jobs that Slurm still queues or runs, and says so."""

    def __init__(self, sweep_dir):
        self.active = active_jobs(sweep_dir)
        self.kept = []

    def __enter__(self):
        self._rmtree = shutil.rmtree
        active, kept, rmtree = self.active, self.kept, self._rmtree

        def guarded_rmtree(path, *args, **kwargs):
            hit = active.get(os.path.abspath(path))
            if hit is not None:
                kept.append(path)
                print(f"domainbed_vasso.slurm: keeping {path}: its Slurm job {hit[0]} is {hit[1]}")
                return None
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = guarded_rmtree
        return self

    def __exit__(self, *exc):
        shutil.rmtree = self._rmtree
        if self.kept:
            print(f"domainbed_vasso.slurm: kept {len(self.kept)} of those folders: their Slurm jobs "
                  "are still queued or running (the count above includes them)")
        return False


# --- status -------------------------------------------------------------------------------

def _result_error(entry):
    """submitit's verdict for a finished task: the first line of its error, or None."""
    import pickle
    base = entry["log_out"][: -len("_log.out")] if entry["log_out"].endswith("_log.out") else None
    path = f"{base}_result.pkl" if base else None
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            outcome, value = pickle.load(f)
    except Exception:  # a half-written pickle: judge by the rest
        return None
    if outcome == "success":
        return None
    lines = [l for l in str(value).strip().splitlines() if l.strip()]
    return lines[-1] if lines else outcome


def sweep_status(sweep_dir, states=None):
    """One dict per job folder of ``sweep_dir``: output_dir, state (queued / running / done /
    failed, or incomplete for a folder Slurm never ran for this sweep), job_id, logs, reason,
    and the job's dataset, algorithm, test_envs, hparams_seed, trial_seed."""
    sweep_dir = os.path.abspath(sweep_dir)
    record = read_record(sweep_dir)
    if record:
        states = squeue_states() if states is None else states
    folders = set(record)
    if os.path.isdir(sweep_dir):
        for name in os.listdir(sweep_dir):
            path = os.path.join(sweep_dir, name)
            if name != SLURM_SUBDIR and os.path.isdir(path):
                folders.add(path)
    rows = []
    for output_dir in sorted(folders):
        entry = record.get(output_dir)
        row = {"output_dir": output_dir, "job_id": None, "logs": [], "reason": ""}
        if entry is not None:
            args = command_args(entry["command"])
            # both: DomainBed's train tees its stderr into stdout, so its traceback is in the
            # .out log; submitit's verdict is in the .err log
            logs = [entry["log_out"]] + ([entry["log_err"]] if entry["log_err"] != entry["log_out"] else [])
            row.update(job_id=entry["job_id"], logs=logs)
            row.update({k: args.get(k, "") for k in
                        ("dataset", "algorithm", "test_envs", "hparams_seed", "trial_seed")})
        if os.path.exists(os.path.join(output_dir, "done")):
            row["state"] = DONE
        elif entry is None:
            row["state"] = INCOMPLETE
            row["reason"] = "no Slurm job recorded for this folder"
        else:
            state = slurm_state(entry["job_id"], states)
            if state is not None:
                row["state"] = state
            else:
                row["state"] = FAILED
                row["reason"] = (_result_error(entry) or
                                 "the Slurm job ended without writing 'done' (cancelled, timed out or killed)")
        rows.append(row)
    return rows


def format_status(rows):
    lines = []
    for r in rows:
        what = " ".join(str(r.get(k, "")) for k in ("dataset", "algorithm")).strip()
        if r.get("test_envs", "") != "":
            what += f" test_envs=[{r['test_envs']}] hparams_seed={r['hparams_seed']} trial_seed={r['trial_seed']}"
        line = f"{r['state']:<10} {r['job_id'] or '-':<12} {r['output_dir']}"
        if what:
            line += f" ({what})"
        if r["state"] in (FAILED, QUEUED, RUNNING):
            line += "".join(f"\n{'':<23} log: {log}" for log in r["logs"])
        if r["reason"]:
            line += f"\n{'':<23} {r['reason']}"
        lines.append(line)
    counts = {s: sum(r["state"] == s for r in rows) for s in (DONE, RUNNING, QUEUED, FAILED, INCOMPLETE)}
    lines.append(f"{len(rows)} jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def status_main(argv=None):
    """``python -m domainbed_vasso.sweep status --output_dir SWEEP_DIR``."""
    import argparse
    parser = argparse.ArgumentParser(
        prog="python -m domainbed_vasso.sweep status",
        description="Each job folder of a sweep as queued, running, done or failed (with its Slurm "
                    "log), from the sweep's Slurm record, squeue and the folders' 'done' files.")
    parser.add_argument("--output_dir", required=True, help="the sweep's --output_dir")
    args, _ = parser.parse_known_args(argv)  # accepts the rest of a sweep command line
    if not os.path.isdir(args.output_dir):
        parser.error(f"--output_dir {args.output_dir}: no such directory")
    try:
        rows = sweep_status(args.output_dir)
    except SlurmLauncherError as exc:
        print(f"domainbed_vasso: error: {exc}", file=sys.stderr)
        return 2
    print(format_status(rows))
    return 0
