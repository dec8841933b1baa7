"""scripts/translation/iwslt14_recipe.py: the dry-run commands, and that fairseq-train's own parser
accepts them with the values the paper uses."""

import os
import shlex
import subprocess
import sys

import iwslt14_recipe
from fairseq_vasso.nmt import recipe as nmt_common

PAPER = {"--arch": "transformer_iwslt_de_en", "--adam-betas": "(0.9, 0.98)", "--lr": "5e-4",
         "--lr-scheduler": "inverse_sqrt", "--warmup-updates": "4000", "--weight-decay": "0.0001",
         "--dropout": "0.3", "--criterion": "label_smoothed_cross_entropy", "--label-smoothing": "0.1",
         "--max-tokens": "4096", "--task": "translation"}
OPTIMIZER = {"adamw": ("adam", None, None, False), "sam": ("sam", "0.1", None, False),
             "asam": ("sam", "0.1", None, True), "vasso0.9": ("vasso", "0.1", "0.9", False),
             "vasso0.4": ("vasso", "0.1", "0.4", False)}


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def _dry_run(script, *args):
    out = script(os.path.join("translation", "iwslt14_recipe.py"), "--dry-run", *args).stdout
    cmds = []
    for line in out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        words = shlex.split(line)
        assert words[-2:] == ["2>&1", words[-1]] or words[-3] == ">"
        cmds.append(words[:words.index(">")])
    return out, cmds


def test_dry_run_prints_every_row_and_seed(script, tmp_path):
    out, cmds = _dry_run(script, "--seeds", "1", "2", "3", "--runs", str(tmp_path / "runs"))
    assert len(cmds) == 15
    seen = set()
    for cmd in cmds:
        assert os.path.basename(cmd[0]) == "fairseq-train"
        assert cmd[1] == "data-bin/iwslt14.tokenized.de-en"
        assert "--share-decoder-input-output-embed" in cmd
        for flag, value in PAPER.items():
            assert _value(cmd, flag) == value, flag
        save = _value(cmd, "--save-dir")
        method, seed = save.split(os.sep)[-2], save.split(os.sep)[-1]
        assert seed == "seed" + _value(cmd, "--seed")
        opt, rho, theta, adaptive = OPTIMIZER[method]
        assert _value(cmd, "--optimizer") == opt
        assert _value(cmd, "--rho") == rho
        assert _value(cmd, "--theta") == theta
        assert ("--adaptive" in cmd) == adaptive
        assert _value(cmd, "--user-dir") == nmt_common.default_user_dir()
        seen.add((method, seed))
    assert len(seen) == 15  # one save dir per run
    assert not (tmp_path / "runs").exists()  # nothing ran
    for m in nmt_common.METHODS.values():
        assert m.label in out


def test_dry_run_options_and_passthrough(script):
    _, cmds = _dry_run(script, "--methods", "sam", "--seeds", "7", "--rho", "0.05", "--max-epoch", "0",
                       "--max-update", "100", "--eval-bleu", "--", "--fp16", "--update-freq", "2")
    (cmd,) = cmds
    assert _value(cmd, "--rho") == "0.05" and _value(cmd, "--seed") == "7"
    assert "--max-epoch" not in cmd and _value(cmd, "--max-update") == "100"
    assert _value(cmd, "--best-checkpoint-metric") == "bleu" and "--eval-bleu" in cmd
    assert cmd[-3:] == ["--fp16", "--update-freq", "2"]


def test_fairseq_parses_every_command():
    """fairseq-train's parser (with the user-dir imported) accepts every row's command."""
    cmds = [iwslt14_recipe.train_command("DATA", m, 1, "SAVE/%s" % m) for m in nmt_common.METHODS]
    code = r"""
import json, sys
from fairseq import options
out = []
for argv in json.loads(sys.argv[1]):
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=argv[1:])
    out.append([args.optimizer, args.arch, getattr(args, "rho", None), getattr(args, "theta", None),
                getattr(args, "adaptive", None), list(eval(args.adam_betas)) if isinstance(args.adam_betas, str)
                else list(args.adam_betas), args.weight_decay, args.lr, args.warmup_updates,
                args.share_decoder_input_output_embed, args.max_tokens, args.label_smoothing, args.dropout])
print("RESULT " + json.dumps(out))
"""
    import json

    proc = subprocess.run([sys.executable, "-c", code, json.dumps(cmds)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][0][7:])
    common = [[0.9, 0.98], 0.0001, [0.0005], 4000, True, 4096, 0.1, 0.3]
    assert rows[0][:2] == ["adam", "transformer_iwslt_de_en"] and rows[0][5:] == common
    assert rows[1][:5] == ["sam", "transformer_iwslt_de_en", 0.1, None, False] and rows[1][5:] == common
    assert rows[2][:5] == ["sam", "transformer_iwslt_de_en", 0.1, None, True] and rows[2][5:] == common
    assert rows[3][:4] == ["vasso", "transformer_iwslt_de_en", 0.1, 0.9] and rows[3][5:] == common
    assert rows[4][:4] == ["vasso", "transformer_iwslt_de_en", 0.1, 0.4] and rows[4][5:] == common


def test_judge_train_by_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("... | INFO | fairseq_cli.train | done training in 12.3 seconds\n"
                   "terminate called without an active exception\n")
    assert iwslt14_recipe.judge_train(134, str(log))[0]
    assert iwslt14_recipe.judge_train(0, str(tmp_path / "missing.log"))[0]
    log.write_text("Traceback (most recent call last):\n")
    ok, note = iwslt14_recipe.judge_train(1, str(log))
    assert not ok and "exit status 1" in note


def test_a_finished_run_is_skipped_and_an_interrupted_one_resumes_its_log(script, tmp_path):
    # run again, the recipe leaves a finished run's log and checkpoints as they are; the
    # others resume (fairseq: from checkpoint_last.pt) with their log going on
    runs = tmp_path / "runs"
    finished = runs / "adamw" / "seed1"
    finished.mkdir(parents=True)
    (finished / "train.log").write_text("epoch 050 | ... \ndone training in 3600.0 seconds\n")
    (finished / "checkpoint_last.pt").write_bytes(b"fifty epochs")
    before = {p.name: p.read_bytes() for p in finished.iterdir()}
    out = script(os.path.join("translation", "iwslt14_recipe.py"), "--runs", runs, "--methods", "adamw",
                 "--seeds", 1, "--data", tmp_path / "no-data").stdout
    assert f"skip adamw seed 1: {finished / 'train.log'} says done training" in out
    assert {p.name: p.read_bytes() for p in finished.iterdir()} == before
    log = tmp_path / "resumed.log"
    log.write_text("the first half of an interrupted run\n")
    assert nmt_common.run_logged([sys.executable, "-c", "print('the rest')"], str(log), append=True) == 0
    assert log.read_text().splitlines()[0] == "the first half of an interrupted run"
    assert log.read_text().splitlines()[-1] == "the rest"
