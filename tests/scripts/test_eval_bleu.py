"""scripts/eval_bleu.py and scripts/demo.py on real fairseq-generate output of tiny models
trained by a scaled-down demo run (see conftest.demo_run)."""

import json
import math
import os
import re
import shutil
import statistics

import pytest

import eval_bleu

METHODS = ["adamw", "sam", "vasso0.4"]


def test_demo_runs_end_to_end(demo_run):
    out, stdout = demo_run
    with open(os.path.join(out, "results.md"), encoding="utf-8") as f:
        text = f.read()
    assert text in stdout
    # two tables, each under its own heading
    assert "## Toy de-en demo: test BLEU with 50 % of the training targets misaligned" in text
    assert "## Per run: training diagnostics of the last epoch" in text
    summary, per_run = text.split("## Per run")
    labels = {"adamw": "AdamW", "sam": "SAM", "vasso0.4": "VASSO (theta=0.4)"}
    rows = {l.split(" | ")[0].strip("| "): [c.strip() for c in l.strip("|").split("|")]
            for l in summary.splitlines() if l.startswith("| ") and not l.startswith("| Method")}
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
    verdicts = [l for l in summary.splitlines() if l.startswith("- ")]
    assert len(verdicts) == 3 and all(("within the seed spread" in v) != ("exceeds the seed spread" in v)
                                      for v in verdicts)
    run_rows = [l for l in per_run.splitlines() if l.startswith("| ") and not l.startswith("| Method")]
    assert [tuple(c.strip() for c in l.strip("|").split("|")[:2]) for l in run_rows] == [
        (labels[m], str(s)) for m in labels for s in (1, 2)]
    # progress while training (per run: updates done, elapsed time, what remains) and while scoring
    assert re.search(r"\[\s*\d+ s\] training: .*(sam|vasso0\.4) s[12] \d+/60.*of the work\); about .* left for "
                     r"training, .* in all", stdout), stdout
    assert re.search(r"BLEU [0-9.]+ \(6 of 6 scored; about 0 s left\)", stdout)
    assert "CPU time:" in stdout and "on 2 idle cores about" in stdout
    # torch's torch.jit.script FutureWarning is not printed (neither by the demo nor by fairseq in the run logs)
    assert "torch.jit.script" not in stdout
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

    out, _ = demo_run
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
    out, _ = demo_run
    runs = tmp_path / "runs"
    # two seeds of SAM: the demo's real checkpoint and a copy of it (same scores, std 0)
    for seed in (1, 2):
        d = runs / "sam" / ("seed%d" % seed)
        d.mkdir(parents=True)
        shutil.copy(os.path.join(out, "runs", "sam", "seed1", "checkpoint_last.pt"), d / "checkpoint_best.pt")
    js, md = tmp_path / "r.json", tmp_path / "r.md"
    proc = script("eval_bleu.py", os.path.join(out, "data-bin"), "--runs", runs, "--jobs", 2,
                  "--generate-args", "--max-len-a 1.2 --max-len-b 10",
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
