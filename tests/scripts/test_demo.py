"""The demo (fairseq_vasso.nmt.demo, run by scripts/demo.py): the seeded table, the verdicts on
the seed spread, the progress reader and the warning filter handed to child processes, without
training; then an interrupted demo resumed to the uninterrupted one's table (the end-to-end
run itself is in test_eval_bleu.py, on the shared demo_run fixture)."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import process_group
import pytest

from fairseq_vasso.nmt import demo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _results(bleus):
    return {(m, s): {"fairseq_bleu": b, "sacrebleu": b - 1.0} for m, per_seed in bleus.items()
            for s, b in zip((1, 2, 3), per_seed)}


def test_summary_table_mean_std_beside_per_seed_values():
    results = _results({"adamw": [50.0, 52.0, 54.0], "sam": [60.0, 61.0, 62.0]})
    stats = {("adamw", s): {"valid_loss": "3.5", "valid_best_loss": "3.0"} for s in (1, 2, 3)}
    stats.update({("sam", s): {"valid_loss": str(3.0 + s / 10), "valid_best_loss": "2.9", "train_loss_gap": "0.05",
                               "train_stability": "0.12"} for s in (1, 2, 3)})
    table = demo.summary_table(["adamw", "sam"], [1, 2, 3], results, stats)
    rows = {l.split(" | ")[0].strip("| "): [c.strip() for c in l.strip("|").split("|")] for l in table.splitlines()[2:]}
    assert rows["AdamW"][1:4] == ["52.00 ± 2.00", "50.00, 52.00, 54.00", "51.00 ± 2.00"]
    assert rows["AdamW"][4:6] == ["3.500 ± 0.000", "3.000 ± 0.000"] and rows["AdamW"][6:] == ["-", "-"]
    assert rows["SAM"][1:3] == ["61.00 ± 1.00", "60.00, 61.00, 62.00"]
    assert rows["SAM"][4] == "3.200 ± 0.100" and rows["SAM"][6:] == ["0.0500 ± 0.0000", "0.1200 ± 0.0000"]
    assert "per seed (s1, s2, s3)" in table.splitlines()[0]


def test_compare_says_whether_differences_exceed_the_seed_spread():
    results = _results({"adamw": [50.0, 52.0, 54.0], "sam": [55.0, 56.0, 57.0], "vasso0.4": [53.0, 56.0, 59.0]})
    lines = demo.compare(["adamw", "sam", "vasso0.4"], [1, 2, 3], results)
    assert len(lines) == 3
    assert lines[0].startswith("SAM − AdamW: +4.00 BLEU (std 1.00 and 2.00 over seeds), exceeds the seed spread: "
                               "every seed of SAM above every seed of AdamW")
    assert lines[1].startswith("VASSO (theta=0.4) − AdamW: +4.00 BLEU") and "within the seed spread" in lines[1]
    assert lines[2].startswith("VASSO (theta=0.4) − SAM: +0.00 BLEU") and "within the seed spread" in lines[2]
    flipped = demo.compare(["adamw", "sam"], [1, 2, 3], _results({"adamw": [60.0, 61.0, 62.0], "sam": [1.0, 2.0, 3.0]}))
    assert "-59.00 BLEU" in flipped[0] and "every seed of AdamW above every seed of SAM" in flipped[0]
    assert "no seed spread" in demo.compare(["adamw", "sam"], [1], results)[0]


def test_updates_done_reads_the_last_num_updates(tmp_path):
    log = tmp_path / "train.log"
    assert demo.updates_done(str(log)) == 0  # not started yet
    log.write_text("+ fairseq-train ...\n")
    assert demo.updates_done(str(log)) == 0
    log.write_text("epoch 001:     10 / 8 loss=9.1, num_updates=10, lr=1e-4\n"
                   "epoch 002 | loss 8.2 | num_updates 16 | lr 2e-4\n" + "x" * 10000 + "\n"
                   "epoch 003:     20 / 8 loss=7.0, num_updates=20, lr=3e-4\n")
    assert demo.updates_done(str(log)) == 20


def test_progress_estimates_remaining_work_in_passes(tmp_path, monkeypatch):
    logs = {m: tmp_path / (m + ".log") for m in ("adamw", "sam")}
    jobs = [("sam", 1, str(logs["sam"])), ("adamw", 1, str(logs["adamw"]))]
    lines = []
    progress = demo.Progress(jobs, 100, lines.append, 60, lambda: 30.0)
    assert progress.remaining() == (None, 0.0)
    progress.set(jobs[0], "running")
    logs["sam"].write_text("epoch 001:     10 / 8 loss=9.1, num_updates=10\n")
    assert progress.remaining() == (None, pytest.approx(20 / 300))  # one observation: no rate yet
    progress.first = (progress.first[0] - 100, progress.first[1])
    logs["sam"].write_text("epoch 001:     50 / 8 loss=9.1, num_updates=50\n")
    # 80 passes in the 100 s since the first update was seen; 200 of 300 passes left
    left, frac = progress.remaining()
    assert frac == pytest.approx(1 / 3) and left == pytest.approx(250, rel=0.01)
    progress.report()
    assert "sam s1 50/100" in lines[-1] and "0 of 2 runs done" in lines[-1] and "33 %" in lines[-1]
    assert "4 min 10 s left for training, 4 min 40 s in all" in lines[-1]


def test_children_get_the_torch_jit_filter_and_keep_other_warnings():
    env = demo.quiet_children_env({"PYTHONWARNINGS": "error::DeprecationWarning", "PATH": "/usr/bin"})
    assert env["PYTHONWARNINGS"].startswith("error::DeprecationWarning,ignore:")
    code = ("import warnings\n"
            "warnings.warn(%r + '. Please switch to torch.compile or torch.export.', FutureWarning)\n"
            "warnings.warn('rho is large', FutureWarning)\n" % demo.TORCH_JIT_WARNING)
    env.pop("PYTHONWARNINGS")
    err = subprocess.run([sys.executable, "-c", code], env=demo.quiet_children_env(env), stderr=subprocess.PIPE,
                         text=True).stderr
    assert "torch.jit.script" not in err and "rho is large" in err


@pytest.mark.parametrize("argv, flag", [(["--train-noise", "1.5"], "--train-noise"), (["--seeds", "1", "1"], "--seeds"),
                                        (["--methods", "adam"], "--methods"), (["--max-update", "0"], "--max-update"),
                                        (["--progress-every", "0"], "--progress-every")])
def test_bad_arguments_name_the_flag_before_any_work(argv, flag, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        demo.main(argv + ["--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _table(out):
    """results.md without what differs between two folders of the same demo: the vasso-bleu
    command (its paths) and the wall-clock column."""
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"^    .*vasso-bleu .*$", "    VASSO-BLEU COMMAND", text, flags=re.M)
    return re.sub(r"\| [0-9.]+ \|$", "| WALL |", text, flags=re.M)


def _training(log):
    """True once ``log`` is a new fairseq-train log (the partial one replaced): run_logged wrote
    its command line and started it."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return False
    return "epoch 001: num_updates=10" not in text and text.startswith("+ ")


def test_interrupted_demo_stops_at_once_and_the_same_command_finishes_it(demo_run, demo_args, tmp_path, capsys):
    # demo_run's finished demo, as if it had been interrupted before its last run finished
    # (the run's folder holds a partial log); the same command, interrupted again (SIGINT,
    # as Ctrl-C) while that run trains, then run to its end, gives the uninterrupted table
    done, _, _ = demo_run
    out = tmp_path / "demo"
    shutil.copytree(done, out)
    os.remove(out / "results.md")
    last = out / "runs" / "adamw" / "seed2"
    shutil.rmtree(last)
    last.mkdir()
    (last / "train.log").write_text("+ fairseq-train ...\nepoch 001: num_updates=10\n")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "demo.py"), "--out", str(out), *demo_args]
    proc = process_group.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 600
        while not _training(last / "train.log"):  # the run's fairseq-train has started
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1)  # and is importing fairseq
        stopped = time.time()
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert time.time() - stopped < 10
    finally:
        process_group.kill_group(proc)
    assert proc.returncode == 130, stderr[-3000:]
    assert "5 of 6 runs are finished" in stderr and "Run the same command again" in stderr and "--restart" in stderr
    # no fairseq process of this demo is left (each ran in its own group, killed with the demo)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(out) not in ps, ps
    assert not (last / "result.json").exists()
    partial = (out / "results.md").read_text(encoding="utf-8") if (out / "results.md").exists() else None
    # other settings are refused before any work, naming the flag and --restart
    with pytest.raises(SystemExit) as exc:
        demo.main(["--out", str(out), *demo_args, "--max-update", "61"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--max-update 60 there, 61 here" in err and "--restart" in err
    assert not (last / "result.json").exists()
    assert partial is None or (out / "results.md").read_text(encoding="utf-8") == partial
    # the same command finishes the rest: the table of the uninterrupted demo
    again = process_group.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stdout and "5 of 6 runs finished before, kept" in again.stdout
    assert _table(out) == _table(done)


def test_out_that_holds_no_demo_is_refused_even_with_restart(tmp_path, capsys):
    # --restart removes a demo's folder only: never a folder of the user's other files
    (tmp_path / "thesis.tex").write_text("two years of work")
    for extra in ([], ["--restart"]):
        with pytest.raises(SystemExit) as exc:
            demo.main(["--out", str(tmp_path), "--seeds", "1"] + extra)
        assert exc.value.code == 2 and "holds no demo (no demo.json" in capsys.readouterr().err
    assert (tmp_path / "thesis.tex").read_text() == "two years of work"
