"""The demo (scripts/translation/demo.py): the seeded table, the verdicts on
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

import demo
from plugins.lab.stats import permutation_test

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


def _stats(stability):
    return {(m, s): {"train_stability": str(v)} for m, per_seed in stability.items() for s, v in zip((1, 2, 3), per_seed)}


def test_verdicts_come_from_the_exact_permutation_test_never_from_a_heuristic():
    results = _results({"adamw": [50.0, 52.0, 54.0], "sam": [55.0, 56.0, 57.0], "vasso0.4": [53.0, 56.0, 59.0]})
    stats = _stats({"sam": [0.131, 0.135, 0.132], "vasso0.4": [0.073, 0.081, 0.078]})
    lines = demo.compare(["adamw", "sam", "vasso0.4"], [1, 2, 3], results, stats,
                         {"bleu": 0.38, "train_stability": 0.0012})
    assert len(lines) == 4  # three pairs on BLEU, one on stability (AdamW has none)
    assert lines[0] == ("SAM − AdamW: +4.00 BLEU; every seed of SAM above every seed of AdamW; p = 0.10, the smallest "
                        "p that 3 against 3 seeds can give: complete separation, not significance at 0.05; the "
                        "rounding control alone moved one run by 0.38.")
    p = permutation_test([50.0, 52.0, 54.0], [53.0, 56.0, 59.0])
    assert 0.1 < p < 1 and lines[1].startswith("VASSO (theta=0.4) − AdamW: +4.00 BLEU; the seeds of the two overlap; "
                                                "not significant (p = %.2f)" % p)
    assert lines[2].startswith("VASSO (theta=0.4) − SAM: +0.00 BLEU; the seeds of the two overlap; not significant "
                               "(p = 1.00)")
    assert lines[3] == ("VASSO (theta=0.4) − SAM: -0.0553 in stability; every seed of SAM above every seed of VASSO "
                        "(theta=0.4); p = 0.10, the smallest p that 3 against 3 seeds can give: complete separation, "
                        "not significance at 0.05; the rounding control alone moved one run by 0.0012.")
    assert not any("exceed" in line for line in lines)
    # with 5 seeds a difference can be significant
    five = {(m, s): {"fairseq_bleu": b, "sacrebleu": b} for m, vals in (("adamw", [1, 2, 3, 4, 5]),
                                                                         ("sam", [11, 12, 13, 14, 15]))
            for s, b in zip(range(1, 6), vals)}
    [line] = demo.compare(["adamw", "sam"], [1, 2, 3, 4, 5], five)
    assert "significant at 0.05 (p = 0.008)" in line and "rounding" not in line
    assert "no test over seeds" in demo.compare(["adamw", "sam"], [1], results)[0]


def test_the_headline_leads_with_stability_and_says_what_bleu_cannot_show():
    results = _results({"adamw": [11.96, 10.93, 11.32], "sam": [13.77, 11.46, 12.07], "vasso0.4": [10.93, 11.44, 10.06]})
    stats = _stats({"sam": [0.131, 0.135, 0.132], "vasso0.4": [0.073, 0.081, 0.078]})
    stability, bleu = demo.headline(["adamw", "sam", "vasso0.4"], [1, 2, 3], results, stats,
                                    {"bleu": 0.38, "train_stability": 0.0012})
    assert stability.startswith("**Stability** ‖ε_t − ε_{t−1}‖ (the paper's Fig. 4): VASSO (theta=0.4) 0.0773 ± "
                                "0.0040 against SAM 0.1327 ± 0.0021, 0.58 times as much; every seed of VASSO "
                                "(theta=0.4) below every seed of SAM (exact permutation test p = 0.10, the smallest 3 "
                                "against 3 seeds allow); the rounding control moves it by 0.0012, 46 times less")
    # SAM - VASSO is 1.62 BLEU here, and yet no test over 3 seeds can call it a difference
    assert bleu.startswith("**Test BLEU**: no difference of mean test BLEU between methods (0.59 to 1.62) is "
                           "significant (exact two-sided permutation test over seeds, smallest p 0.10; with 3 seeds "
                           "against 3 no p below 0.10 is possible)")
    assert "rounding alone (the control) moved one run by 0.38" in bleu
    assert bleu.endswith("On this toy corpus, BLEU differences between the methods are within noise.")
    text = demo.limits([1, 2, 3])
    assert "all 20 ways" in text and "smallest two-sided p it can give is 0.100" in text
    assert "no difference between two methods can be significant at 0.05" in text and "at least 4 seeds" in text


def test_the_rounding_control_prints_its_band_beside_the_seed_spread():
    args = demo.parse_args(["--seeds", "1", "2", "3"])
    results = _results({"adamw": [11.0, 11.5, 12.0], "sam": [13.77, 11.46, 12.07]})
    results["sam", 1, "control"] = {"fairseq_bleu": 14.15, "sacrebleu": 14.0}
    stats = {("sam", s): {"valid_loss": str(v), "train_loss_gap": "0.1", "train_stability": str(t)}
             for s, v, t in ((1, 3.222, 0.1309), (2, 3.289, 0.1348), (3, 3.274, 0.1320))}
    stats["sam", 1, "control"] = {"valid_loss": "3.230", "train_loss_gap": "0.1", "train_stability": "0.1311"}
    table, bands = demo.rounding_control(args, results, stats)
    rows = {l.split(" | ")[0].strip("| "): [c.strip() for c in l.strip("|").split("|")][1:] for l in table.splitlines()[2:]}
    assert rows["SAM s1"] == ["13.77", "12.77", "3.222", "0.1000", "0.1309"]
    assert rows["SAM s1, every initial weight 1 float up"] == ["14.15", "14.00", "3.230", "0.1000", "0.1311"]
    assert rows["**rounding band** (difference)"] == ["0.38", "1.23", "0.008", "0.0000", "0.0002"]
    assert rows["seed spread (std of SAM over seeds 1, 2, 3)"][0] == "1.20"
    assert bands["bleu"] == pytest.approx(0.38) and bands["train_stability"] == pytest.approx(0.0002)
    # nothing until both runs are scored, nothing with --control none
    del results["sam", 1, "control"]
    assert demo.rounding_control(args, results, stats) == ("", {})
    assert demo.rounding_control(demo.parse_args(["--control", "none"]), results, stats) == ("", {})


def test_help_prints_each_default_once():
    text = demo.build_parser().format_help()
    blocks = re.split(r"\n(?=  -)", text)
    assert len(blocks) > 20
    doubled = [b.split()[0] for b in blocks if b.count("(default:") > 1]
    assert not doubled, doubled
    assert "(default: --max-len-a 1.2 --max-len-b 10)" in " ".join(text.split())


def test_cpu_children_see_no_gpu(monkeypatch, tmp_path):
    # --cpu: the demo's fairseq-train and fairseq-generate see no GPU (stock fairseq's --cpu still takes the
    # gradient norm through a visible one: recipe.cpu_only_env); without it, the environment's devices
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert demo.child_env(1, cpu=True)["CUDA_VISIBLE_DEVICES"] == ""
    assert demo.child_env(1)["CUDA_VISIBLE_DEVICES"] == "0"
    assert demo.child_env(1, cpu=True)["OMP_NUM_THREADS"] == "1"
    # and run_all gives it to every fairseq-train it starts under --cpu (the training stubbed: it fails at once)
    seen = []
    monkeypatch.setattr(demo, "train_one", lambda *a, **kw: seen.append(a[5]["CUDA_VISIBLE_DEVICES"]) or (False, "stub"))
    for flags, device in ((["--cpu"], ""), ([], "0")):
        args = demo.parse_args(["--methods", "sam", "--seeds", "1", "--control", "none", *flags])
        with pytest.raises(SystemExit, match="training failed"):
            demo.run_all("data", "ref", str(tmp_path / "out"), args, "user_dir", "bleu", lambda msg: None)
        assert seen.pop() == device


def test_children_get_a_fixed_thread_count_whatever_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert demo.build_parser().parse_args([]).threads == 1
    env = demo.child_env(1, {"PATH": "/usr/bin"})
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "1"
    # and the scoring's fairseq-generate gets the same (vasso-bleu alone: cores / jobs)
    from fairseq_vasso.nmt import bleu

    seen = []
    monkeypatch.setattr(bleu, "evaluate_checkpoint", lambda *a, env, **kw: seen.append(env["OMP_NUM_THREADS"]) or {
        "fairseq_bleu": 1.0, "sacrebleu": 1.0, "n": 1, "seconds": 0.0, "output": "x"})
    bleu.score("data", [("sam", 1, "ckpt")], env=env, threads=1, say=lambda line: None)
    bleu.score("data", [("sam", 1, "ckpt")], env=env, say=lambda line: None)
    assert seen == ["1", "64"]


def test_control_must_be_one_of_the_methods(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        demo.main(["--methods", "adamw", "vasso0.4", "--out", str(tmp_path / "out")])
    assert exc.value.code == 2 and "--control: must be one of --methods (adamw, vasso0.4) or 'none'" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _save_line(save_dir, epoch, updates):
    return ("2026-11-27 | INFO | fairseq.checkpoint_utils | Saved checkpoint %s/checkpoint_best.pt (epoch %d @ %d "
            "updates, score 7.6) (writing took 0.07 seconds)\n" % (save_dir, epoch, updates))


def test_resume_point_is_the_checkpoint_and_its_log_up_to_that_save(tmp_path):
    import torch

    log = tmp_path / "train.log"
    head = ("+ fairseq-train ...\nepoch 001:  10 / 12 loss=9.1, num_updates=10\n" + _save_line(tmp_path, 1, 12)
            + "2026 | INFO | fairseq_cli.train | end of epoch 1 (average epoch stats below)\n"
            "2026 | INFO | train | epoch 001 | loss 8.089 | num_updates 12 | wall 8\n")
    log.write_text(head + "2026 | INFO | fairseq.tasks.fairseq_task | can_reuse_epoch_itr = True\n"
                   "epoch 002:  10 / 12 loss=7.0, num_updates=20\n")
    assert demo.resume_point(str(tmp_path), str(log)) is None  # no checkpoint yet
    torch.save({"optimizer_history": [{"num_updates": 12}]}, tmp_path / "checkpoint_last.pt")
    assert demo.resume_point(str(tmp_path), str(log)) == (12, head)
    # a checkpoint whose save the log does not show, or one cut short while written: from the start
    torch.save({"optimizer_history": [{"num_updates": 24}]}, tmp_path / "checkpoint_last.pt")
    assert demo.resume_point(str(tmp_path), str(log)) is None
    (tmp_path / "checkpoint_last.pt").write_bytes(b"PK\x03\x04 cut short")
    assert demo.resume_point(str(tmp_path), str(log)) is None


def test_nudge_up_moves_every_weight_one_float_and_a_shared_one_once():
    import torch

    from fairseq_vasso.hooks import nudge_up

    emb = torch.nn.Embedding(5, 3)
    out = torch.nn.Linear(3, 5, bias=True)
    out.weight = emb.weight  # tied, as --share-decoder-input-output-embed
    torch.nn.init.zeros_(out.bias)
    model = torch.nn.ModuleList([emb, out])
    before = [q.detach().clone() for q in model.parameters()]
    assert len(before) == 2
    nudge_up(model.parameters(), 1)
    for q, b in zip(model.parameters(), before):
        assert torch.equal(q, torch.nextafter(b, torch.full_like(b, float("inf"))))
    nudge_up(model.parameters(), 0)
    assert torch.equal(out.bias, torch.full((5,), torch.finfo(torch.float32).smallest_normal * 2.0 ** -23))


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
    from fairseq_vasso._foreign_warnings import AT_FAIRSEQ_IMPORT

    env = demo.quiet_children_env({"PYTHONWARNINGS": "error::DeprecationWarning", "PATH": "/usr/bin"})
    assert env["PYTHONWARNINGS"].startswith("error::DeprecationWarning,ignore:")
    code = ("import warnings\n"
            "warnings.warn(%r + '. Please switch to torch.compile or torch.export.', FutureWarning)\n"
            "warnings.warn('rho is large', FutureWarning)\n" % AT_FAIRSEQ_IMPORT[0])
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


def test_nudged_train_with_0_ulps_is_stock_fairseq_train_and_1_ulp_is_not(demo_run, tmp_path):
    # the rounding control runs fairseq-train in-process (scripts/translation/nudged_train.py): with 0 ulps
    # it must be stock fairseq-train bit for bit, so that the control differs from its run by the nudge alone
    import torch

    import iwslt14_recipe
    from fairseq_vasso.nmt import recipe

    done, _, _ = demo_run

    # a folder with another fairseq_vasso, where the control runs from and which PYTHONPATH names first (as
    # a copy of the checkout would): the child must still import the --user-dir's, or fairseq refuses it
    decoy = tmp_path / "decoy"
    (decoy / "fairseq_vasso").mkdir(parents=True)
    (decoy / "fairseq_vasso" / "__init__.py").write_text("raise ImportError('the decoy fairseq_vasso')\n")

    def train(name, prefix):
        args = recipe.toy_train_args(os.path.join(done, "data-bin"), tmp_path / name, lr=5e-3, max_update=3, seed=1,
                                     optimizer_flags=["--optimizer", "vasso", "--rho", "0.1", "--theta", "0.4"])
        log = str(tmp_path / (name + ".log"))
        env, cwd = demo.child_env(1, cpu=True), None  # as the demo's --cpu runs its children
        if name != "stock":
            env, cwd = dict(env, PYTHONPATH=os.pathsep.join([str(decoy), env.get("PYTHONPATH", "")])), str(decoy)
        rc = recipe.run_logged(prefix + args + ["--cpu", "--no-epoch-checkpoints"], log, env=env, cwd=cwd)
        assert iwslt14_recipe.judge_train(rc, log)[0], recipe.tail(log)
        # in fairseq's log format, in which the demo reads the control's row (last_epoch_stats)
        with open(log, encoding="utf-8") as f:
            assert "| INFO | fairseq_cli.train | done training" in f.read(), (name, recipe.tail(log))
        return torch.load(tmp_path / name / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]

    stock, zero, one = (train("stock", [recipe.fairseq_bin("fairseq-train")]),
                        train("zero", demo.nudged_train_command(0)),
                        train("one", demo.nudged_train_command(1)))
    assert stock.keys() == zero.keys() == one.keys() and len(stock) > 11
    assert all(torch.equal(stock[k], zero[k]) for k in stock)
    differ = [k for k in stock if not torch.equal(stock[k], one[k])]
    assert differ and max(float((stock[k] - one[k]).abs().max()) for k in stock) < 1e-3


def _saved_mid_way(log, max_update):
    """The updates of the last checkpoint ``log`` says fairseq-train saved, if before ``max_update`` (else None).
    fairseq logs the save once checkpoint_last.pt is written whole."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None
    saves = [int(m.group(1)) for m in demo._SAVED_RE.finditer(text)]
    return saves[-1] if saves and 0 < saves[-1] < max_update - 10 else None


def test_interrupted_demo_stops_at_once_and_resumes_its_runs_from_their_checkpoints(demo_run, demo_args, tmp_path,
                                                                                   capsys):
    # demo_run's finished demo, as if interrupted early: VASSO seed 2 not started yet (its folder
    # removed), AdamW seed 2 cut short before its first checkpoint (a partial log only). The same
    # command, interrupted (SIGINT, as Ctrl-C) once VASSO seed 2 has saved a checkpoint mid-way,
    # stops at once; run again, it resumes VASSO seed 2 from that checkpoint, as fairseq-train
    # itself resumes (its logs kept, the table marking it), and trains AdamW seed 2 from the start
    done, _, _ = demo_run
    out = tmp_path / "demo"
    shutil.copytree(done, out)
    for name in ("results.md", "results.json"):
        os.remove(out / name)
    vasso = out / "runs" / "vasso0.4" / "seed2"
    shutil.rmtree(vasso)
    adamw = out / "runs" / "adamw" / "seed2"
    shutil.rmtree(adamw)
    adamw.mkdir()
    partial = "+ fairseq-train ...\nepoch 001: num_updates=10\n"
    (adamw / "train.log").write_text(partial)
    cmd = [sys.executable, os.path.join(REPO, "scripts", "translation", "demo.py"), "--out", str(out), *demo_args]
    proc = process_group.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.time() + 600
        while not _saved_mid_way(vasso / "train.log", 60):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        stopped = time.time()
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
        assert time.time() - stopped < 10
    finally:
        process_group.kill_group(proc)
    assert proc.returncode == 130, stderr[-3000:]
    assert re.search(r"[56] of 7 runs are finished", stderr) and "Run the same command again" in stderr
    assert "resumes from its last checkpoint" in stderr and "--restart" in stderr
    # no fairseq process of this demo is left (each ran in its own group, killed with the demo)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(out) not in ps, ps
    assert not (vasso / "result.json").exists()
    partial_table = (out / "results.md").read_text(encoding="utf-8") if (out / "results.md").exists() else None
    # other settings are refused before any work, naming the flag and --restart
    with pytest.raises(SystemExit) as exc:
        demo.main(["--out", str(out), *demo_args, "--max-update", "61"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--max-update 60 there, 61 here" in err and "--restart" in err
    assert not (vasso / "result.json").exists()
    assert partial_table is None or (out / "results.md").read_text(encoding="utf-8") == partial_table
    # the same command finishes the rest, VASSO seed 2 from its checkpoint
    interrupted = (vasso / "train.log").read_text(encoding="utf-8")
    again = process_group.run(cmd, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming" in again.stdout and re.search(r"[56] of 7 runs finished before, kept", again.stdout)
    at = int(re.search(r"vasso0\.4 s2: resuming from checkpoint_last\.pt at update (\d+)", again.stdout).group(1))
    assert 0 < at < 50
    # the interrupted log is kept whole; train.log is its history up to that checkpoint, then the resumed
    # run, which loaded the checkpoint and went on from the next update
    assert (vasso / "train.interrupted-1.log").read_text(encoding="utf-8") == interrupted
    log = (vasso / "train.log").read_text(encoding="utf-8")
    history, resumed = log.split("[demo] interrupted after this save; resumed from checkpoint_last.pt at update "
                                 "%d (the interrupted log: train.interrupted-1.log)\n" % at)
    assert interrupted.startswith(history) and "@ %d updates" % at in history
    assert re.search(r"Loaded checkpoint \S+checkpoint_last\.pt \(epoch \d+ @ %d updates\)" % at, resumed)
    updates = [int(n) for n in re.findall(r"num_updates[=\s]+(\d+)", resumed)]
    assert updates and min(updates) > at and max(updates) == 60
    assert demo.read_json(str(vasso / "result.json"))["resumed_at"] == [at]
    # AdamW seed 2 had no checkpoint: it trained from the start, its partial log kept (then, interrupted
    # beside VASSO seed 2, it finished, or resumed from a checkpoint of its own, or started again)
    assert (adamw / "train.interrupted-1.log").read_text() == partial
    # the table: the uninterrupted demo's numbers for every run trained without a resume, VASSO seed 2 marked
    unresumed = [(m, s) for m, s in [("adamw", 1), ("adamw", 2), ("sam", 1), ("sam", 2), ("vasso0.4", 1)]
                 if not demo.read_json(os.path.join(out, "runs", m, "seed%d" % s, "result.json"))["resumed_at"]]
    assert len(unresumed) >= 4
    for method, seed in unresumed:
        a, b = (demo.read_json(os.path.join(d, "runs", method, "seed%d" % seed, "result.json")) for d in (done, out))
        assert (a["fairseq_bleu"], a["sacrebleu"]) == (b["fairseq_bleu"], b["sacrebleu"]), (method, seed)
    table = (out / "results.md").read_text(encoding="utf-8")
    vasso_row = next(l for l in table.splitlines() if l.startswith("| VASSO (theta=0.4) | ") and "±" in l)
    assert vasso_row.split(" | ")[2].endswith("(resumed)") and "(resumed)" not in vasso_row.split(" | ")[2].split(",")[0]
    assert "Marked (resumed): resumed from its checkpoint_last.pt" in table and "VASSO (theta=0.4) s2 at update %d" % at \
        in table
    assert demo.read_json(str(out / "results.json"))["complete"]


def test_out_that_holds_no_demo_is_refused_even_with_restart(tmp_path, capsys):
    # --restart removes a demo's folder only: never a folder of the user's other files
    (tmp_path / "thesis.tex").write_text("two years of work")
    for extra in ([], ["--restart"]):
        with pytest.raises(SystemExit) as exc:
            demo.main(["--out", str(tmp_path), "--seeds", "1"] + extra)
        assert exc.value.code == 2 and "holds no demo (no demo.json" in capsys.readouterr().err
    assert (tmp_path / "thesis.tex").read_text() == "two years of work"
