"""vasso-bleu (fairseq_vasso.nmt.bleu) and scripts/translation/demo.py on real fairseq-generate output of tiny
models trained by a scaled-down demo run (see conftest.demo_run)."""

import json
import math
import os
import re
import shutil
import statistics

import process_group
import pytest
import torch

from fairseq_vasso.nmt import bleu as eval_bleu

METHODS = ["adamw", "sam", "vasso0.4"]


def test_demo_runs_end_to_end(demo_run):
    out, stdout, stderr = demo_run
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        text = f.read()
    assert text in stdout
    # two tables, each under its own heading
    assert "## Toy de-en demo: test BLEU with 50 % of the training targets misaligned" in text
    assert "## Per run: training diagnostics of the last epoch" in text
    summary, per_run = text.split("## Per run")
    labels = {"adamw": "AdamW", "sam": "SAM", "vasso0.4": "VASSO (theta=0.4)"}
    rows = {r[0]: r for r in summary_rows(summary)}
    assert sorted(rows) == sorted(labels.values())
    for m, label in labels.items():
        # the per-seed values are the BLEU4 lines fairseq-generate wrote for checkpoint_last.pt of each seed
        per_seed = [eval_bleu.parse_generate(os.path.join(out, "runs", m, "seed%d" % s, "generate-test",
                                                          "generate-test.txt"))["bleu"] for s in (1, 2)]
        assert rows[label][2] == "%.2f, %.2f" % tuple(per_seed)
        assert rows[label][1] == "%.2f ± %.2f" % (statistics.mean(per_seed), statistics.stdev(per_seed))
        assert re.fullmatch(r"\d+\.\d{3} ± \d+\.\d{3}", rows[label][4])  # last valid loss
    # loss gap and stability: logged by the two-pass methods only
    assert rows["AdamW"][6:] == ["-", "-"]
    for label in ("SAM", "VASSO (theta=0.4)"):
        assert all(re.fullmatch(r"\d+\.\d{4} ± \d+\.\d{4}", c) for c in rows[label][6:]), rows[label]
    # the verdicts: three pairs on BLEU, SAM and VASSO on stability, each from the permutation test
    verdicts = [l for l in summary.splitlines() if l.startswith("- ")]
    assert len(verdicts) == 4 and all(re.search(r"p = [01]\.\d\d", v) for v in verdicts), verdicts
    assert sum(" BLEU; " in v for v in verdicts) == 3 and "in stability" in verdicts[3]
    assert "What 2 seeds can show" in summary and "exceed" not in summary
    # led by the stability result, then what BLEU cannot show
    assert summary.index("**Stability**") < summary.index("**Test BLEU**") < summary.index("| Method |")
    # the rounding control (SAM seed 1, initial weights one float up), beside the seed spread
    control = [l for l in summary.splitlines() if l.startswith("| ") and " | " in l]
    assert any(l.startswith("| SAM s1, every initial weight 1 float up |") for l in control)
    assert any(l.startswith("| **rounding band** (difference) |") for l in control)
    nudged = os.path.join(out, "control", "sam", "seed1-1ulp")
    assert "/scripts/translation/nudged_train.py 1 -- " in open(os.path.join(nudged, "train.log"),
                                                               encoding="utf-8").readline()
    run_rows = [l for l in per_run.splitlines() if l.startswith("| ") and not l.startswith("| Method")]
    assert [tuple(c.strip() for c in l.strip("|").split("|")[:2]) for l in run_rows] == [
        (labels[m], str(s)) for m in labels for s in (1, 2)][:2] + [
        ("SAM", "1"), ("SAM", "1, +1 ulp (control)"), ("SAM", "2"), ("VASSO (theta=0.4)", "1"),
        ("VASSO (theta=0.4)", "2")]
    # beside results.md, the same numbers machine-readable
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        summary_json = json.load(f)
    assert summary_json["complete"] and summary_json["settings"]["threads"] == 1
    assert len(summary_json["runs"]) == 7 and sum(r["control"] for r in summary_json["runs"]) == 1
    for r in summary_json["runs"]:
        assert r["torch"] == torch.__version__ and r["cpu_capability"] and r["resumed_at"] == []
        per_seed_cell = rows[labels[r["method"]]][2].split(", ")[r["seed"] - 1]
        assert r["control"] or per_seed_cell == "%.2f" % r["fairseq_bleu"]
    assert {t["quantity"] for t in summary_json["tests"]} == {"bleu", "train_stability"}
    assert all(t["smallest_p"] == pytest.approx(1 / 3) for t in summary_json["tests"])
    # progress while training (per run: updates done, elapsed time, what remains) and while scoring
    assert re.search(r"\[\s*\d+ s\] training: .*(sam|vasso0\.4) s[12] \d+/60.*of the work\); about .* left for "
                     r"training, .* in all", stdout), stdout
    assert re.search(r"fairseq BLEU [0-9.]+, sacreBLEU [0-9.]+ \(40 sentences, \d+ s", stdout)
    assert "1 of 7 runs scored, table (partial) in" in stdout and "7 of 7 runs scored, table in" in stdout
    # the stages in order: every run scored, the table, then stage 3's plots (Fig. 4, then Fig. 3)
    last_scored = stdout.rindex("runs scored, table in")
    assert last_scored < stdout.index("## Toy de-en demo") < stdout.index("stage 3/3: plots") < stdout.index(
        "diagnostics plot (stability") < stdout.index("| SNR | method |") < stdout.index("done; table in")
    assert stdout.count("| SNR | method |") == 1
    assert "it/s]" not in stderr  # no library's tqdm bar (subword-nmt draws one over the BPE merges)
    assert "CPU time:" in stdout and "on 2 idle cores about" in stdout
    # torch's torch.jit.script FutureWarning is not printed (neither by the demo nor by fairseq in the run logs)
    assert "torch.jit.script" not in stdout + stderr
    with open(os.path.join(out, "runs", "sam", "seed1", "train.log"), encoding="utf-8") as f:
        assert "torch.jit.script" not in f.read()
    for m in METHODS:
        for s in (1, 2):
            assert os.path.exists(os.path.join(out, "runs", m, "seed%d" % s, "checkpoint_last.pt"))
    # the training targets are noisy, valid and test clean: the binarized train set was built from raw/train.en
    with open(os.path.join(out, "raw", "train.en"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 500
    # it ends by plotting its own runs' diagnostics (Fig. 4) and the sphere (Fig. 3)
    for png in ("diagnostics.png", "adversaries.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_parse_real_generate_output(demo_run):
    """H/T lines and the BLEU4 line of fairseq-generate, cross-checked with sacrebleu."""
    import sacrebleu

    out, _, _ = demo_run
    data = os.path.join(out, "data-bin")
    n = eval_bleu.dataset_size(data, "test")
    assert n == 40
    with open(os.path.join(out, "tok", "test.en"), encoding="utf-8") as f:
        refs_plain = f.read().split("\n")[:-1]
    for m in METHODS:
        path = os.path.join(out, "runs", m, "seed1", "generate-test", "generate-test.txt")
        parsed = eval_bleu.parse_generate(path)
        assert parsed["ids"] == list(range(n))  # no sentence dropped
        assert parsed["subset"] == "test" and parsed["beam"] == 5
        assert parsed["refs"] == refs_plain  # T- lines are the BPE-removed references
        assert not any("@@" in h for h in parsed["hyps"])
        # fairseq's BLEU4 is tokenized BLEU on these strings
        ours = sacrebleu.corpus_bleu(parsed["hyps"], [parsed["refs"]], tokenize="none", smooth_method="none",
                                     force=True)
        assert math.isclose(ours.score, parsed["bleu"], abs_tol=0.011), (m, ours.score, parsed["bleu"])
        # "BLEU4 = b, p1/p2/p3/p4 (BP=.., ratio=.., syslen=N, reflen=M)"
        fields = re.search(r"BLEU4 = [0-9.]+, ([0-9.]+)/([0-9.]+)/([0-9.]+)/([0-9.]+) .*syslen=(\d+), reflen=(\d+)",
                           parsed["bleu_line"]).groups()
        assert [int(fields[4]), int(fields[5])] == [ours.sys_len, ours.ref_len]
        for theirs, mine in zip(fields[:4], ours.precisions):
            assert abs(float(theirs) - mine) <= 0.051, (m, parsed["bleu_line"], ours.precisions)
        # sacreBLEU on detokenized text
        sacre, sig = eval_bleu.sacrebleu_score(parsed["hyps"], parsed["refs"])
        assert 0.0 <= sacre <= 100.0 and "tok:13a" in sig


def test_eval_bleu_cli_mean_std_and_paper(demo_run, script, tmp_path):
    out, _, _ = demo_run
    runs = tmp_path / "runs"
    # two seeds of SAM: the demo's real checkpoint and a copy of it (same scores, std 0)
    for seed in (1, 2):
        d = runs / "sam" / ("seed%d" % seed)
        d.mkdir(parents=True)
        shutil.copy(os.path.join(out, "runs", "sam", "seed1", "checkpoint_last.pt"), d / "checkpoint_best.pt")
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    proc = script("fairseq_vasso.nmt.bleu", os.path.join(out, "data-bin"), "--runs", runs, "--jobs", 2,
                  "--generate-args", "--max-len-a 1.2 --max-len-b 10", "--batch-size", 8,
                  "--ref-file", os.path.join(out, "tok", "test.en"), "--json", js, "--out", md)
    results = json.loads(js.read_text())
    assert sorted((r["method"], r["seed"]) for r in results) == [("sam", 1), ("sam", 2)]
    s1, s2 = results
    assert s1["fairseq_bleu"] == s2["fairseq_bleu"] and s1["sacrebleu"] == s2["sacrebleu"] and s1["n"] == 40
    # the same scores as the demo's own evaluation of the same checkpoint
    demo = eval_bleu.parse_generate(os.path.join(out, "runs", "sam", "seed1", "generate-test", "generate-test.txt"))
    assert s1["fairseq_bleu"] == demo["bleu"]
    table = md.read_text()
    assert table in proc.stdout.replace("\r", "")
    rows = {l.split(" | ")[0].strip("| "): l.split(" | ") for l in table.splitlines() if l.startswith("| ")}
    assert rows["SAM"][1] == "34.75"
    assert rows["SAM"][2] == "%.2f ± 0.00" % s1["fairseq_bleu"]
    assert rows["SAM"][3] == "%.2f ± 0.00" % s1["sacrebleu"]
    assert rows["SAM"][4] == "2"
    assert rows["SAM"][5].startswith("s1: %.2f / %.2f, s2: " % (s1["fairseq_bleu"], s1["sacrebleu"]))
    # progress per checkpoint and batch, with the elapsed time (40 sentences, batches of 8)
    for seed in (1, 2):
        assert re.search(r"\] sam seed %d \(checkpoint \d/2\): batch 5/5, \d+ s elapsed" % seed, proc.stdout)
    # at most one line per checkpoint about the length limit (this model is undertrained), and
    # as the limits came from --generate-args, no advice to set them
    limit = [l for l in proc.stdout.splitlines() if "length limit" in l]
    assert len(limit) <= 2 and all("set by --generate-args" in l and "pass --generate-args" not in l
                                   for l in limit), limit


def test_eval_bleu_says_when_generation_runs_into_the_length_limit(demo_run, script):
    """--max-len-b 1 makes every hypothesis stop at the limit: one line says so and names
    --generate-args; the scores are still computed."""
    out, _, _ = demo_run
    ckpt = os.path.join(out, "runs", "adamw", "seed1", "checkpoint_best.pt")
    proc = script("fairseq_vasso.nmt.bleu", os.path.join(out, "data-bin"), "--checkpoint", "adamw=" + ckpt,
                  "--generate-args", "--max-len-a 0 --max-len-b 1", "--batch-size", 8)
    warnings = [l for l in proc.stdout.splitlines() if "length limit" in l]
    assert len(warnings) == 1, proc.stdout
    # said as soon as it shows (after a batch or two), so out of the hypotheses so far
    assert re.search(r": (\d+) of \1 hypotheses stop at the length limit \(--max-len-a 0 --max-len-b 1\)", warnings[0])
    assert "| AdamW |" in proc.stdout


def test_scoring_leaves_nothing_in_the_temp_dir(demo_run, script, tmp_path):
    """vasso-bleu's fairseq-generate runs without a loader process: fairseq's default one is
    terminated at exit and would leave its multiprocessing folder (pymp-*) in TMPDIR."""
    out, _, _ = demo_run
    temp = tmp_path / "temp"
    temp.mkdir()
    ckpt = os.path.join(out, "runs", "adamw", "seed1", "checkpoint_best.pt")
    script("fairseq_vasso.nmt.bleu", os.path.join(out, "data-bin"), "--checkpoint", "adamw=" + ckpt,
           "--generate-args", "--max-len-a 0 --max-len-b 1", "--batch-size", 8, env=dict(os.environ, TMPDIR=str(temp)))
    assert not list(temp.iterdir()), sorted(p.name for p in temp.iterdir())


def test_length_limit_watch_counts_hypotheses_at_the_limit(tmp_path):
    out = tmp_path / "generate-test.txt"
    watch = eval_bleu.LengthLimitWatch(str(out), *eval_bleu.length_limits([]))
    assert (watch.max_len_a, watch.max_len_b) == (0.0, 200)  # fairseq's defaults
    watch.update()  # no file yet
    assert watch.hypotheses == 0 and not watch.mostly_at_limit
    with open(out, "w") as f:
        f.write("S-0\tein hund\nP-0\t%s\nS-1\tkatze\nP-1\t-0.1 -0.2\nS-2\tx\nP-2\t" % " ".join(["-1"] * 201))
        f.flush()
        watch.update()  # P-2 is incomplete: not counted yet
        assert (watch.hypotheses, watch.at_limit) == (2, 1) and not watch.mostly_at_limit
        f.write(" ".join(["-1"] * 201) + "\n")
    watch.update()
    assert (watch.hypotheses, watch.at_limit) == (3, 2) and watch.mostly_at_limit
    # fairseq's default limits: the line says how to bound them
    assert watch.message("x") == (
        "x: 2 of 3 hypotheses stop at the length limit (--max-len-a 0 --max-len-b 200), fairseq-generate's "
        "default: the model looks undertrained and generation is slow; to bound it, pass --generate-args "
        "\"--max-len-a 1.2 --max-len-b 10\" (fairseq README's validation limits; the scores are then not "
        "comparable with the paper's)")
    bounded = eval_bleu.LengthLimitWatch(str(out), *eval_bleu.length_limits(["--max-len-a", "1.2", "--max-len-b", "10"]))
    bounded.update()  # limits 13, 12, 12 (1.2 * source length + 10): the two long hypotheses are at them
    assert (bounded.hypotheses, bounded.at_limit) == (3, 2)


def test_help_shows_each_default_once_and_every_option_has_help(script):
    text = script("fairseq_vasso.nmt.bleu", "--help").stdout
    ref = text[text.index("\n  --ref-file"):text.index("\n  --cpu")]
    assert ref.count("default") == 1
    parser = eval_bleu.build_parser()
    for action in parser._actions:
        assert action.help, action.dest


def test_markdown_table_statistics():
    rs = [dict(method="sam", seed=s, fairseq_bleu=b, sacrebleu=b - 1) for s, b in [(1, 34.0), (2, 35.0), (3, 36.0)]]
    rs.append(dict(method="toy", seed=1, fairseq_bleu=10.0, sacrebleu=9.0))
    table = eval_bleu.markdown_table(rs)
    assert "| SAM | 34.75 | 35.00 ± 1.00 | 34.00 ± 1.00 | 3 | s1: 34.00 / 33.00, s2: 35.00 / 34.00, s3: 36.00 / 35.00 |" in table
    assert "| toy | - | 10.00 | 9.00 | 1 | s1: 10.00 / 9.00 |" in table
    assert "paper" not in eval_bleu.markdown_table(rs, paper_column=False)


def test_find_runs_in_recipe_layout(tmp_path):
    for method, seed in [("vasso0.4", 2), ("adamw", 10), ("adamw", 2), ("other", 1)]:
        d = tmp_path / method / ("seed%d" % seed)
        d.mkdir(parents=True)
        (d / "checkpoint_best.pt").write_bytes(b"")
    (tmp_path / "sam" / "seed1").mkdir(parents=True)  # no checkpoint: skipped
    found = [(m, s) for m, s, _ in eval_bleu.find_runs(str(tmp_path))]
    assert found == [("adamw", 2), ("adamw", 10), ("vasso0.4", 2), ("other", 1)]


def summary_rows(text):
    """The cells of each row of the demo's summary table (the one under "| Method | test BLEU")."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("| Method | test BLEU"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def demo_columns(table_text):
    """{label: (test BLEU mean ± std, sacreBLEU mean ± std)} of the demo's summary table."""
    return {r[0]: (r[1], r[3]) for r in summary_rows(table_text.split("## Per run")[0])}


def test_the_printed_vasso_bleu_command_reproduces_the_demo_table_without_overwriting(demo_run):
    out, stdout, _ = demo_run
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        text = f.read()
    commands = [l.strip() for l in text.splitlines() if l.startswith("    ") and "vasso-bleu " in l]
    assert len(commands) == 1, text
    command = commands[0]
    assert command in stdout and "--checkpoint-name checkpoint_last.pt" in command
    # the demo's own thread count (1 unless --threads), not the cores of whoever runs it
    assert "--threads 1 " in command
    demo_output = os.path.join(out, "runs", "sam", "seed1", "generate-test", "generate-test.txt")
    with open(demo_output, "rb") as f:
        before = f.read()
    mtime = os.stat(demo_output).st_mtime_ns
    # run by hand, from where the demo ran (tests/scripts/conftest.py: the folder of its --out)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]))  # the code under test, also in the console script
    proc = process_group.run(["bash", "-c", command], capture_output=True, text=True, timeout=600, env=env,
                             cwd=os.path.dirname(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {l.split(" | ")[0].strip("| "): [c.strip() for c in l.strip().strip("|").split("|")]
            for l in proc.stdout.splitlines() if l.startswith("| ") and not l.startswith("| Method")}
    mine = {label: (r[1], r[2]) for label, r in rows.items()}  # fairseq BLEU, sacreBLEU (no paper column)
    assert mine == demo_columns(text)
    # into new folders: the demo's output is untouched
    with open(demo_output, "rb") as f:
        assert f.read() == before and os.stat(demo_output).st_mtime_ns == mtime
    assert os.path.exists(os.path.join(out, "runs", "sam", "seed1", "generate-test-2", "generate-test.txt"))


def test_fresh_dir_never_reuses_a_folder(tmp_path):
    base = str(tmp_path / "generate-test")
    assert eval_bleu.fresh_dir(base) == base
    assert eval_bleu.fresh_dir(base) == base + "-2"
    assert eval_bleu.fresh_dir(base) == base + "-3"


def test_errors_name_what_was_looked_for_and_where(script, tmp_path):
    data = tmp_path / "data-bin"
    data.mkdir()
    runs = tmp_path / "runs"
    (runs / "sam" / "seed1").mkdir(parents=True)
    (runs / "sam" / "seed1" / "checkpoint_last.pt").write_bytes(b"")
    proc = script("fairseq_vasso.nmt.bleu", data, "--runs", runs, check=False)
    assert proc.returncode == 2
    assert (f"--runs given but no checkpoint matched checkpoint_best.pt under {runs} (1 run folder(s) there hold "
            "checkpoint_last.pt; --checkpoint-name picks another file)") in proc.stderr
    proc = script("fairseq_vasso.nmt.bleu", data, "--runs", tmp_path / "nowhere", check=False)
    assert f"--runs {tmp_path / 'nowhere'}: no such directory (looked for " in proc.stderr
    proc = script("fairseq_vasso.nmt.bleu", data, "--checkpoint", "sam=" + str(tmp_path / "x.pt"), check=False)
    assert f"--checkpoint sam={tmp_path / 'x.pt'}: no such file" in proc.stderr
    proc = script("fairseq_vasso.nmt.bleu", tmp_path / "nodata", "--runs", runs, "--checkpoint-name",
                  "checkpoint_last.pt", check=False)
    assert f"data: no such directory: {tmp_path / 'nodata'}" in proc.stderr
    for flag in ("--threads", "--jobs"):
        proc = script("fairseq_vasso.nmt.bleu", data, "--runs", runs, "--checkpoint-name", "checkpoint_last.pt",
                      flag, 0, check=False)
        assert proc.returncode == 2 and f"{flag} must be >= 1, got 0" in proc.stderr
    (tmp_path / "table.md").write_text("an earlier table")
    proc = script("fairseq_vasso.nmt.bleu", data, "--runs", runs, "--checkpoint-name", "checkpoint_last.pt",
                  "--out", tmp_path / "table.md", check=False)
    assert proc.returncode == 2 and "--out %s exists: give a new file, or --force" % (tmp_path / "table.md") in proc.stderr
    assert (tmp_path / "table.md").read_text() == "an earlier table"
