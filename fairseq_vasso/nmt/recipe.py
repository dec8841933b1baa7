"""The paper's NMT rows and fairseq's console scripts, for ``vasso-bleu``
(:mod:`fairseq_vasso.nmt.bleu`), the self-test, and the recipes in ``scripts/``.

* ``METHODS``: the rows of the paper's table ``tab.nmt`` and the fairseq
  optimizer flags that select each (``--optimizer adam`` is fairseq's AdamW:
  decoupled weight decay), with the paper's test BLEU;
* where the fairseq console scripts and the ``fairseq_vasso`` user-dir are;
* ``toy_train_args``: the tiny transformer on the toy corpus (self-test, tests);
  ``child_argv``: the command line of the children that run fairseq-train in-process (the benchmark, the self-test);
* ``run_logged``: run a fairseq command with its output in a log file (in a process group
  of its own, which ``interruptible()`` ends on Ctrl-C or SIGTERM).
"""

import collections
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading

Method = collections.namedtuple("Method", "name label paper_bleu flags")


def _method(name, label, paper_bleu, flags):
    return Method(name, label, paper_bleu, tuple(flags))


# rho = 0.1 for every sharpness-aware row: "Hyperparameter rho is tuned for SAM from
# {0.01, 0.05, 0.1, 0.2}, and rho = 0.1 performs the best. The same rho is picked for
# ASAM and VASSO." (paper, Sec. 5).  "{rho}" is filled in by method_flags().
METHODS = collections.OrderedDict(
    (m.name, m)
    for m in [
        _method("adamw", "AdamW", 34.66, ["--optimizer", "adam"]),
        _method("sam", "SAM", 34.75, ["--optimizer", "sam", "--rho", "{rho}"]),
        _method("asam", "ASAM", 34.76, ["--optimizer", "sam", "--adaptive", "--rho", "{rho}"]),
        _method("vasso0.9", "VASSO (theta=0.9)", 34.81, ["--optimizer", "vasso", "--rho", "{rho}", "--theta", "0.9"]),
        _method("vasso0.4", "VASSO (theta=0.4)", 34.88, ["--optimizer", "vasso", "--rho", "{rho}", "--theta", "0.4"]),
    ]
)
PAPER_RHO = 0.1


def method_flags(name, rho=PAPER_RHO):
    return [f.format(rho=rho) for f in METHODS[name].flags]


def run_dir(runs, method, seed):
    """The recipe's save dir of one run: RUNS/<method>/seed<k>."""
    return os.path.join(runs, method, "seed%d" % seed)


def toy_train_args(data, save_dir, *, optimizer_flags, lr, max_update, seed=3):
    """fairseq-train's arguments (no program name) for the toy corpus
    (:mod:`fairseq_vasso.nmt.toy_corpus`), as the self-test and the fairseq tests train
    it: a 1+1-layer transformer of width 32 with label-smoothed cross-entropy, AdamW's
    betas and weight decay, an inverse-sqrt schedule warming up over 4 updates, JSON
    logs of every update.  ``optimizer_flags`` pick the optimizer (``["--optimizer",
    "vasso", "--rho", "0.1"]``); the caller adds the device, saving and the rest."""
    return [str(data), "--user-dir", default_user_dir(),
            "--task", "translation", "--source-lang", "de", "--target-lang", "en",
            "--arch", "transformer", "--encoder-layers", "1", "--decoder-layers", "1",
            "--encoder-embed-dim", "32", "--decoder-embed-dim", "32",
            "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
            "--encoder-attention-heads", "2", "--decoder-attention-heads", "2",
            "--share-decoder-input-output-embed", "--dropout", "0.1",
            "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            *optimizer_flags, "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.0001",
            "--lr", str(lr), "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4",
            "--max-tokens", "400", "--max-update", str(max_update), "--seed", str(seed),
            "--num-workers", "0", "--save-dir", str(save_dir), "--log-format", "json", "--log-interval", "1"]


def child_argv(argv, module, first):
    """The command line of a child that runs fairseq-train in this process
    (``python -m MODULE FIRST -- FAIRSEQ_TRAIN_ARGS...``): ``(FIRST, FAIRSEQ_TRAIN_ARGS)``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(f"usage: python -m {module} {first} -- FAIRSEQ_TRAIN_ARGS...")
    return argv[0], argv[2:]


def cpu_only_env(env=None):
    """``env`` (default ``os.environ``) with no GPU visible (``CUDA_VISIBLE_DEVICES`` empty):
    the environment of a fairseq child run with ``--cpu``, which then runs as on a CPU-only
    host.  Stock fairseq's ``--cpu`` leaves CUDA in use where a GPU is visible: its
    ``utils.clip_grad_norm_``, called on every update, puts the gradient norm on
    ``torch.cuda.current_device()`` (``--clip-norm X`` with X > 0 then stops with "scalar
    tensor is expected to be on cpu but is on cuda:0"; at fairseq's default of 0 every update
    still goes through the GPU), and its default ``--distributed-world-size`` is the number
    of visible GPUs."""
    env = dict(os.environ if env is None else env)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def fairseq_bin(name):
    """The fairseq console script next to this Python (a venv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(here):
        return here
    found = shutil.which(name)
    if not found:
        raise SystemExit("%s not found: install fairseq into this Python's environment" % name)
    return found


def default_user_dir():
    """The folder to pass to ``--user-dir``: the ``fairseq_vasso`` package's own."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Stopped(Exception):
    """A command was not started: Ctrl-C or SIGTERM stopped the tool (``interruptible``)."""


_children = set()  # the process groups run_logged has running, each led by its Popen
_children_lock = threading.Lock()
_stopping = threading.Event()


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_children():
    """Kills every command ``run_logged`` has running (their whole process groups, fairseq's
    workers included) and refuses to start more (``Stopped``)."""
    with _children_lock:
        _stopping.set()
        running = list(_children)
    for proc in running:
        _kill_group(proc)


@contextlib.contextmanager
def interruptible():
    """While inside, Ctrl-C (SIGINT) and SIGTERM kill the commands run_logged started (each in
    its own process group, so the terminal's Ctrl-C reaches only this process) and raise
    KeyboardInterrupt in the main thread: a tool whose commands run in threads stops within
    a second instead of waiting for them. Main thread only."""
    def on_signal(signum, frame):
        stop_children()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    saved = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    _stopping.clear()
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def run_logged(cmd, log_path, env=None, cwd=None, on_line=None, append=False):
    """Runs cmd with stdout+stderr in log_path (after what it holds, with ``append``);
    returns the exit status.

    ``on_line(line)``, when given, sees every output line as it comes (for progress). The
    command runs in a session of its own: an exception or interrupt while waiting for it
    (and ``stop_children``) kills its whole process group."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write("+ " + shlex.join(cmd) + "\n")
        log.flush()
        pipe = on_line is not None
        with _children_lock:
            if _stopping.is_set():
                raise Stopped(shlex.join(cmd[:1]))
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if pipe else log, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, text=True, encoding="utf-8", errors="replace",
                                    start_new_session=True)
            _children.add(proc)
        try:
            if pipe:
                for line in proc.stdout:
                    log.write(line)
                    log.flush()
                    on_line(line)
            return proc.wait()
        except BaseException:
            _kill_group(proc)
            raise
        finally:
            with _children_lock:
                _children.discard(proc)
            if pipe:
                proc.stdout.close()
            proc.wait()


def tail(path, n=30):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except FileNotFoundError:
        return ""
