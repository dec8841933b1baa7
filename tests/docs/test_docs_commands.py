"""The docs own their commands: every command in README.md and docs/*.md is classified
in COMMANDS below and exercised, so that a documented command cannot rot silently.

Extraction. Code blocks are fenced (```lang) or indented by four spaces. A ```text
(or ```output) block is output and holds no command. A ```python block is one Python
snippet. Every other block is shell: one command per line, backslash continuations
joined, ``#`` comments dropped, blanks outside quotes collapsed to one space.

Identity. A shell command is keyed by that normalized text, a Python snippet by
``python: <its first line>``: the same key anywhere in the docs means the same
command, classified once. A documented command that changes is unclassified again,
and the failure message prints a ready-to-paste entry.

Classification (one of):

* ``run()``: runs as written.
* ``substitute(why, ...)``: runs after the listed replacements (a data path, the
  DomainBed checkout for ``/path/to/DomainBed``, a smaller model, fewer updates), each
  of which must still match the documented text.
* ``check_only(why, check=None)``: too big for CI (GPU-scale recipe, network, hours of
  CPU): only ``check`` runs, by default the command with ``--help`` appended.

Execution. Like a newcomer with a fresh clone after the README's setup: every command
runs from a workspace that holds a copy of what a clone holds (the files git tracks, and
new files that are not ignored; ``.venv`` is a link to the environment running the
tests), so that nothing a command writes (``runs/``, ``data/``, ``out/``, ...) can land
in the checkout or touch the user's results there; under bash, with that
environment *not* on PATH (the docs must say ``.venv/bin/...`` or activate it) and
without DOMAINBED_ROOT (the docs must export it). Export lines of the same file that
come before a command are replayed first, as in the shell session that reads the
file top to bottom. Commands that need another command's output name it in
``needs``; identical scripts run once per session. ``{DOMAINBED_ROOT}`` in a
replacement stands for the test's DomainBed checkout (the ``DOMAINBED_ROOT`` of the
test command); the commands that need it skip without one.
"""

import glob
import hashlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import cpu_only
import process_group
import pytest
from checkout import clone_files, copy_clone

from plugins.lab import pinned_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, REPO)
                                   for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
OUTPUT_LANGS = {"text", "output", "console-output"}
DOMAINBED = os.path.abspath(os.environ["DOMAINBED_ROOT"]) if os.environ.get("DOMAINBED_ROOT") else None


# ------------------------------------------------------------------ the classification

@dataclass(frozen=True)
class How:
    kind: str                      # "run", "substitute" or "check"
    why: str = ""
    replace: tuple = ()            # ((documented text, replacement), ...)
    append: str = ""               # appended to the command (substitute)
    prelude: str = ""              # Python run before a snippet (substitute)
    check: str = None              # the command that check_only runs instead
    needs: tuple = ()              # keys of commands whose output this one reads
    expect: tuple = ()             # substrings the output must contain
    domainbed: bool = False        # needs a DomainBed checkout
    timeout: int = 300


def run(**kw):
    return How("run", **kw)


def substitute(why, replace=(), **kw):
    return How("substitute", why=why, replace=tuple(dict(replace).items()), **kw)


def check_only(why, check=None, **kw):
    return How("check", why=why, check=check, **kw)


def classified(*entries):
    """{key: How} from (key, How) pairs; a key classified twice is an error."""
    table = {}
    for key, how in entries:
        assert key not in table, f"classified twice in COMMANDS: {key}"
        table[key] = how
    return table


DEMO = ".venv/bin/python scripts/translation/demo.py"
# The demo at test scale: the same pipeline (corpus, Moses, BPE, preprocess, fairseq-train
# with adam, sam and vasso, fairseq-generate, BLEU, tables, plots) with a tiny model, one
# seed and 40 updates (4 log lines, which the plotting commands read).
TINY_DEMO = (" --seeds 1 --train 2000 --valid 30 --test 30 --bpe-merges 60 --embed-dim 32 --layers 1"
             " --max-update 40 --warmup-updates 20")
# fairseq-train's model of the IWSLT recipe, shrunk (later flags override the arch's defaults)
TINY_TRANSFORMER = (" --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 --decoder-embed-dim 32"
                    " --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 --encoder-attention-heads 2"
                    " --decoder-attention-heads 2 --max-update 2 --no-save --disable-validation")
FAIRSEQ_TRAIN = (".venv/bin/fairseq-train data-bin/iwslt14.tokenized.de-en --user-dir fairseq_vasso "
                 "--task translation --arch transformer_iwslt_de_en --share-decoder-input-output-embed "
                 "--optimizer vasso --rho 0.1 --theta 0.4 --adam-betas '(0.9, 0.98)' --lr 5e-4 "
                 "--lr-scheduler inverse_sqrt --warmup-updates 4000 --weight-decay 0.0001 --dropout 0.3 "
                 "--criterion label_smoothed_cross_entropy --label-smoothing 0.1 --max-tokens 4096 "
                 "--log-format simple --log-interval 10")
DOMAINBED_TRAIN = (".venv/bin/python -m domainbed_vasso.train --data_dir ./data --dataset PACS --algorithm VASSO "
                   "--test_envs 0 --output_dir out/ "
                   "--hparams '{\"rho\": 0.05, \"theta\": 0.4, \"resnet50_augmix\": false}'")
FINISHED_SWEEP = "reads a finished sweep of the four image datasets (a GPU job)"
GPU_DOMAINBED = "PACS and the other image datasets: downloads of several GB and a ResNet-50, a GPU job"
# A model with dropout and BatchNorm, a batch, a loss and VASSO after one step (so that
# the snippet's step has an eps_{t-1}), for the snippets of the explicit API
EXPLICIT_PRELUDE = ("import torch\n"
                    "from plugins import VASSO\n"
                    "torch.manual_seed(0)\n"
                    "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),\n"
                    "                            torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))\n"
                    "batch = (torch.randn(16, 4), torch.randint(0, 3, (16,)))\n"
                    "def loss(model, batch):\n"
                    "    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])\n"
                    "opt = VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)\n"
                    "loss(model, batch).backward()\n"
                    "opt.perturb(); opt.zero_grad(); loss(model, batch).backward(); opt.descend()\n"
                    "opt.zero_grad()\n")
EXPLICIT_CHECK = ("print(opt.diagnostics)\n"
                  "assert opt.diagnostics['two_pass'] == 1 and opt.diagnostics['stability'] > 0\n")
# The reader's model (BatchNorm and dropout), batches, losses and the classic repository's
# BatchNorm helpers (theirs toggle the momentum: these do the same), for docs/migration.md
MIGRATION_PRELUDE = ("import torch\n"
                     "from plugins import SAM\n"
                     "torch.manual_seed(0)\n"
                     "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),\n"
                     "                            torch.nn.Dropout(0.1), torch.nn.Linear(8, 3))\n"
                     "batches = [(torch.randn(16, 4), torch.randint(0, 3, (16,))) for _ in range(4)]\n"
                     "inputs, targets = batches[0]\n"
                     "loss_fn = criterion = torch.nn.CrossEntropyLoss()\n"
                     "def smooth_crossentropy(pred, gold):\n"
                     "    return torch.nn.functional.cross_entropy(pred, gold, label_smoothing=0.1, reduction='none')\n"
                     "def disable_running_stats(model):\n"
                     "    for m in model.modules():\n"
                     "        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):\n"
                     "            m.saved_momentum, m.momentum = m.momentum, 0\n"
                     "def enable_running_stats(model):\n"
                     "    for m in model.modules():\n"
                     "        if hasattr(m, 'saved_momentum'):\n"
                     "            m.momentum = m.saved_momentum\n")
SLURM = "needs a Slurm cluster (tests/slurm runs the launcher on a local one)"
LOCAL_SLURM = ("needs Slurm's packages and starts daemons that must be stopped (tests/slurm starts and stops "
               "one; scripts/local_slurm.sh runs as the user, checked as root and as nobody)")
COLLECT_ONLY = "runs a part of the suite that CI runs anyway: collecting it checks the paths and imports"

# docs/fairseq.md's CPU quick start, one command after the other
QUICK_CORPUS = ".venv/bin/python -m fairseq_vasso.nmt.toy_corpus runs/quickstart/raw --train 2000 --valid 100 --test 100"
QUICK_PREPROCESS = ("test -f runs/quickstart/data-bin/dict.en.txt || .venv/bin/fairseq-preprocess --source-lang de "
                    "--target-lang en --trainpref runs/quickstart/raw/train --validpref runs/quickstart/raw/valid "
                    "--testpref runs/quickstart/raw/test --destdir runs/quickstart/data-bin --joined-dictionary "
                    "--workers 1")
QUICK_TRAIN = (".venv/bin/fairseq-train runs/quickstart/data-bin --user-dir fairseq_vasso --task translation "
               "--arch transformer --encoder-layers 2 --decoder-layers 2 --encoder-embed-dim 128 "
               "--decoder-embed-dim 128 --encoder-ffn-embed-dim 256 --decoder-ffn-embed-dim 256 "
               "--encoder-attention-heads 4 --decoder-attention-heads 4 --share-all-embeddings --optimizer vasso "
               "--rho 0.1 --theta 0.4 --adam-betas '(0.9, 0.98)' --lr 2e-3 --lr-scheduler inverse_sqrt "
               "--warmup-updates 100 --dropout 0.1 --criterion label_smoothed_cross_entropy --label-smoothing 0.1 "
               "--max-tokens 2048 --max-update 300 --num-workers 0 --seed 1 --save-dir runs/quickstart/vasso/seed1 "
               "--no-epoch-checkpoints --log-format simple --log-interval 5")
QUICK_BLEU = (".venv/bin/vasso-bleu runs/quickstart/data-bin --checkpoint "
              "vasso=runs/quickstart/vasso/seed1/checkpoint_last.pt --generate-args '--max-len-a 1.2 --max-len-b 10' "
              "--no-paper")
QUICK_START = (QUICK_CORPUS, QUICK_PREPROCESS, QUICK_TRAIN, QUICK_BLEU)
# the quick start runs after the line that docs/fairseq.md gives to pin the CPU kernels where its
# stated BLEU applies (pinned_kernels.unmeasured() is None), so that it gives that BLEU
# (test_quick_start_bleu_is_the_documented_one); elsewhere that test checks that it learns, and
# the pin would make it 2x slower (an Intel Xeon) for nothing
QUICK_PIN = [pinned_kernels.EXPORT] if pinned_kernels.unmeasured() is None else []
# docs/distributed.md: DDP, FSDP2 and ZeRO on 2 gloo ranks, each checkpointed and resumed
DIST_EXAMPLE = ".venv/bin/torchrun --nproc_per_node 2 scripts/distributed_example.py --out runs/distributed"
DIST_EXCERPT = ("an excerpt of scripts/distributed_example.py, which the example command runs (one run: the "
                "same script)")

COMMANDS = classified(
    # ---- README.md
    ("bash scripts/setup_env.sh && .venv/bin/python scripts/translation/demo.py", substitute(
        "scripts/test.sh ran setup_env.sh before pytest; the full demo takes 5 to 18 minutes",
        {"bash scripts/setup_env.sh && ": ""}, append=TINY_DEMO, timeout=600, expect=("BLEU",))),
    (".venv/bin/pip install --no-build-isolation '.[fairseq,sharding,domainbed,slurm,plot]'", check_only(
        "it would change the test's environment: pip resolves it from what is installed, without the network",
        check=".venv/bin/pip install --dry-run --no-index --no-build-isolation '.[fairseq,sharding,domainbed,slurm,plot]'",
        expect=("Would install vasso-plugins",))),
    ("bash scripts/test.sh -ra", check_only(
        "the test command itself: CI runs it, and this test runs inside it",
        check="bash -n scripts/test.sh")),
    ("python: import torch", substitute(
        "the snippet uses the reader's model, criterion and batch",
        prelude="import torch\n"
                "torch.manual_seed(0)\n"
                "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))\n"
                "criterion = torch.nn.CrossEntropyLoss()\n"
                "x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))\n",
        expect=("ascent_norm",))),
    (FAIRSEQ_TRAIN, substitute(
        "IWSLT-14 needs a download and the model is GPU-sized: the demo's binarized toy corpus, "
        "a 1+1-layer model of width 32, 2 updates",
        {"data-bin/iwslt14.tokenized.de-en": "runs/demo/data-bin"}, append=TINY_TRANSFORMER,
        needs=(DEMO,), expect=("done training",))),
    ("export DOMAINBED_ROOT=/path/to/DomainBed", substitute(
        "the test's DomainBed checkout", {"/path/to/DomainBed": "{DOMAINBED_ROOT}"}, domainbed=True)),
    (".venv/bin/pip install gdown", check_only(
        "network, and it would change the test's environment: pip's own flags parse",
        expect=("--upgrade",))),
    (".venv/bin/python -m domainbed_vasso.download --data_dir ./data PACS", check_only(
        "a download of about 200 MB (tests/domainbed checks the error that names this command)",
        expect=("TerraIncognita",))),
    (DOMAINBED_TRAIN, check_only(GPU_DOMAINBED, domainbed=True, expect=("--test_envs",))),

    # ---- docs/benchmarks.md
    (".venv/bin/vasso-selftest --ranks 2 --json selftest.json", check_only(
        "the whole self-test, 1-2 minutes on 2 cores: tests/selftest runs it (python -m plugins.lab.selftest "
        "--ranks 2 --json ..., the console script's entry point) and checks its report; here its flags parse",
        check=".venv/bin/python -m plugins.lab.selftest --help", expect=("--ranks", "--force"))),
    ("bash scripts/test_gpu.sh", check_only(
        "needs GPUs (without one it refuses, saying so): the script parses",
        check="bash -n scripts/test_gpu.sh")),
    ("PYTHON=/path/to/the/nodes/python3 bash scripts/test_gpu.sh --wheelhouse /tmp/vasso-wheels --install-only",
     check_only("needs a wheelhouse and the node's Python (tests/scripts/test_gpu_offline_install.py rehearses "
                "it with one it builds): its usage names the flags",
                check="bash scripts/test_gpu.sh --help", expect=("--install-only", "PYTHON", "--wheelhouse"))),
    ("PYTHON=/path/to/the/nodes/python3 bash scripts/test_gpu.sh --wheelhouse /tmp/vasso-wheels", check_only(
        "needs GPUs and a wheelhouse (without a GPU it refuses, saying so): its usage names the flags",
        check="bash scripts/test_gpu.sh --help", expect=("--wheelhouse", "--python PATH"))),
    ("PYTHON=/path/to/python3.12 bash scripts/wheelhouse.sh /tmp/vasso-wheels --python-version 3.12 "
     "--platform manylinux_2_28_x86_64 --torch 2.11.0 --constraint node-constraints.txt", check_only(
        "the command above with a file of constraints (tests/scripts/test_wheelhouse_refusals.py refuses a missing "
        "one): its usage names the flag",
        check="bash scripts/wheelhouse.sh --help", expect=("--constraint FILE",))),
    ("PYTHON=/path/to/python3.12 bash scripts/wheelhouse.sh /tmp/vasso-wheels --python-version 3.12 "
     "--platform manylinux_2_28_x86_64 --torch 2.11.0", check_only(
        "minutes of downloads and a fairseq build for another Python (tests/scripts/test_wheelhouse_refusals.py "
        "runs its checks): its usage names the flags",
        check="bash scripts/wheelhouse.sh --help", expect=("--python-version", "--platform", "--torch", "PYTHON"))),
    ("PYTHON=/path/to/the/nodes/python3 bash scripts/test_gpu.sh --node-platform", substitute(
        "this environment's Python stands for the node's",
        replace={"/path/to/the/nodes/python3": ".venv/bin/python"},
        expect=("bash scripts/wheelhouse.sh /tmp/vasso-wheels --python-version 3.", "--platform manylinux_2_",
                "--torch "))),

    (".venv/bin/python scripts/benchmark/benchmark.py", check_only(
        "about 10 minutes of timing on 2 cores (tests/bench runs its parts): its flags parse",
        expect=("--quick", "--host-cost"))),
    (".venv/bin/python scripts/benchmark/benchmark.py --device cuda --reference-vasso ~/src/VaSSO --reference-sam ~/src/sam "
     "--markdown gpu.md --json gpu.json", check_only(
        "needs a GPU and checkouts of the two anchors (tests/bench runs the device benchmark on the CPU): "
        "these flags parse", expect=("--reference-vasso", "--fail-on-miss"))),
    (".venv/bin/python -m pytest tests/bench", check_only(
        COLLECT_ONLY, check=".venv/bin/python -m pytest -q --collect-only tests/bench")),

    # ---- docs/migration.md
    ("python: from plugins import rng_state", substitute(
        "the snippet uses the reader's model, batch, loss and optimizer",
        prelude=MIGRATION_PRELUDE + "optimizer = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1)\n",
        append="assert optimizer.num_steps == 1 and not optimizer.in_flight\nprint('one step')\n",
        expect=("one step",))),
    ("python: from plugins import SAM", substitute(
        "the snippet uses the reader's model, batches and the classic repository's loss and BatchNorm helpers",
        prelude=MIGRATION_PRELUDE, expect=("ascent_norm",))),
    ("python: optimizer = SAM(model.parameters(), torch.optim.SGD, rho=2.0, rho_min=0.2, gsam_alpha=0.4,",
     substitute("the snippet uses the reader's model, batches and loss", prelude=MIGRATION_PRELUDE,
                append="assert 0.2 < optimizer.diagnostics['rho'] < 2.0\n")),
    ("python: from plugins import VASSO", substitute(
        "the snippet uses the reader's model, batches and criterion", prelude=MIGRATION_PRELUDE,
        expect=("stability",))),
    ("python: from composer import Trainer", check_only(
        "Composer is not a dependency of this project: only our side of the snippet runs",
        check=".venv/bin/python -c 'import torch; from plugins import SAM; "
              "m = torch.nn.Linear(2, 1); SAM(m.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)'")),

    # ---- docs/torch.md
    ("python: rng = rng_state()", substitute(
        "the snippet uses the reader's model, batch, loss and optimizer", prelude=EXPLICIT_PRELUDE
        + "from plugins import rng_state\n", append=EXPLICIT_CHECK, expect=("stability",))),
    ("python: opt = SAM(model.parameters(), torch.optim.AdamW, rho=0.05, rho_min=0.0, gsam_alpha=0.3,", substitute(
        "the snippet uses the reader's model; the check runs the schedule to its end",
        prelude="import torch\nfrom plugins import SAM\nmodel = torch.nn.Linear(4, 3)\n",
        append="rhos = []\n"
               "for step in range(10001):\n"
               "    rhos.append(opt.current_rho())\n"
               "    opt.base_optimizer.step()\n"
               "    sched.step()\n"
               "assert rhos[0] == 0.0 and max(rhos) == 0.05 and abs(rhos[-1] - 5e-4) < 1e-12, rhos[-1]\n"
               "print('rho', rhos[0], max(rhos), rhos[-1])\n",
        expect=("rho 0.0 0.05",))),

    # ---- docs/diagnostics.md
    (".venv/bin/vasso-plot RUNS/sam/seed1 RUNS/vasso0.4/seed1 -o RUNS/diagnostics.png",
     substitute("RUNS: the demo's run folders", {"RUNS/": "runs/demo/runs/"}, needs=(DEMO,))),
    (".venv/bin/vasso-plot out/sam/results.jsonl out/vasso/results.jsonl "
     "-o domainbed_diagnostics.png --smooth 5",
     check_only("reads two DomainBed trainings' results (the docs' trainings are GPU jobs)")),
    (".venv/bin/python -m plugins.lab.plot.sphere -o adversaries.png --theta 0.4 --seed 0 -n 100", run()),

    # ---- docs/distributed.md
    (DIST_EXAMPLE, run(expect=("fsdp2  2 ranks", "identical"), timeout=300)),
    ('python: model = DDP(make_model())', check_only(DIST_EXCERPT, check=DIST_EXAMPLE)),  # the DDP and ZeRO ones
    ('python: mesh = init_device_mesh("cpu", (dist.get_world_size(),))', check_only(DIST_EXCERPT, check=DIST_EXAMPLE)),
    ('python: state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}',
     check_only(DIST_EXCERPT, check=DIST_EXAMPLE)),
    ("python: model = FSDP(make_model())", check_only(
        "fairscale's FSDP computes on CUDA only; tests/distributed/test_flat_shards.py runs this optimizer over "
        "FSDP's flat shards, made by hand and by torch's FSDP1, on 2 gloo ranks (and 4), in CI's main suite: "
        + COLLECT_ONLY,
        check=".venv/bin/python -m pytest -q --collect-only tests/distributed/test_flat_shards.py -k 2ranks",
        expect=("4/", "test_torch_fsdp1_flat_shards_give_the_one_process_step[2ranks]"))),

    # ---- docs/reports/gpu.md
    (".venv/bin/python scripts/benchmark/benchmark.py --device cuda --quick --adamw fused --steps-per-round 3 "
     "--seconds 45 --reference-vasso ~/src/VaSSO --reference-sam ~/src/sam", check_only(
        "needs a GPU and checkouts of the two anchors (tests/bench runs the device benchmark on the CPU): "
        "these flags parse", expect=("--steps-per-round", "--reference-sam"))),
    (".venv/bin/python scripts/benchmark/benchmark.py --profile --device cuda --models resnet50", check_only(
        "needs a GPU (tests/bench profiles a step on the CPU): these flags parse", expect=("--profile", "--models"))),

    # ---- docs/reports/digits.md
    (".venv/bin/python scripts/digits/experiments.py labelnoise", check_only("about 16 minutes on 2 cores")),
    (".venv/bin/python scripts/digits/experiments.py tradeoff", check_only("about 5 minutes on 2 cores")),
    (".venv/bin/python scripts/digits/experiments.py spectra", check_only("about 5 minutes on 2 cores")),
    ("bash scripts/digits/digits_sweep.sh", check_only(
        "90 DomainBed jobs, about 34 minutes on 2 cores", check="bash -n scripts/digits/digits_sweep.sh")),
    (".venv/bin/python -m pytest tests/digits", check_only(
        COLLECT_ONLY, check=".venv/bin/python -m pytest -q --collect-only tests/digits")),

    # ---- docs/domainbed.md
    (".venv/bin/vasso-domainbed-tables sweep/", check_only(FINISHED_SWEEP)),
    ("git clone https://github.com/facebookresearch/DomainBed /path/to/DomainBed", check_only(
        "network: the test's DomainBed checkout stands for the clone",
        check="test -f {DOMAINBED_ROOT}/domainbed/scripts/train.py", domainbed=True)),
    ("git -C /path/to/DomainBed checkout b93c22a", check_only(
        "the test's DomainBed is a copy of b93c22a without git metadata, and shared: only git's presence",
        check="git --version")),
    (".venv/bin/python -m domainbed_vasso.download --data_dir ./data VLCS OfficeHome TerraIncognita", check_only(
        "downloads of several GB", expect=("TerraIncognita",))),
    (".venv/bin/python -m domainbed_vasso.sweep launch --data_dir ./data --output_dir sweep/ "
     "--datasets PACS VLCS OfficeHome TerraIncognita --algorithms ERM SAM GSAM VASSO "
     "--command_launcher local --hparams '{\"resnet50_augmix\": false, \"freeze_bn\": true}'",
     check_only(GPU_DOMAINBED, domainbed=True, expect=("--command_launcher",))),
    (".venv/bin/python -m domainbed_vasso.collect_results --input_dir sweep/",
     check_only(FINISHED_SWEEP, domainbed=True, expect=("--input_dir",))),
    (".venv/bin/pip install wilds timm", run()),
    ("bash scripts/test.sh -ra tests/domainbed", check_only(
        "sets up the environment, then runs a part of the suite that CI runs anyway",
        check="bash -n scripts/test.sh && .venv/bin/python -m pytest -q --collect-only tests/domainbed")),
    ("bash scripts/setup_env.sh --with-domainbed", check_only(
        "scripts/test.sh ran setup_env.sh before pytest (and it clones from GitHub)",
        check="bash -n scripts/setup_env.sh")),
    ("bash scripts/setup_env.sh --with-domainbed=/path/to/DomainBed@b93c22a", check_only(
        "scripts/test.sh ran setup_env.sh before pytest; it would change the test's environment",
        check="bash -n scripts/setup_env.sh")),
    (".venv/bin/python -m domainbed_vasso.train --data_dir ./unused --dataset RotatedDigits --algorithm VASSO "
     "--test_envs 0 --output_dir out_digits/", check_only(
        "not yet timed for CI by the docs test (a run() candidate)", domainbed=True,
        expect=("--test_envs",))),
    ("OMP_NUM_THREADS=1 .venv/bin/python -m domainbed_vasso.sweep launch --data_dir ./unused "
     "--output_dir sweep_digits/ --datasets RotatedDigits --algorithms ERM VASSO --n_hparams 1 --n_trials 1 "
     "--command_launcher local --skip_confirmation", check_only(
        "20 DomainBed jobs, 127 s on 2 idle cores (docs/domainbed.md)", domainbed=True, expect=("--command_launcher",))),
    (".venv/bin/python -m domainbed_vasso.collect_results --input_dir sweep_digits/", check_only(
        "reads the sweep above", domainbed=True, expect=("--input_dir",))),
    ("export DOMAINBED_VASSO_SLURM='{\"slurm_partition\": \"gpu\", \"gpus_per_node\": 1, "
     "\"cpus_per_task\": 8, \"mem_gb\": 32, \"timeout_min\": 240, \"slurm_array_parallelism\": 64}'", run()),
    ("export DOMAINBED_VASSO_RESNET_WEIGHTS=/shared/resnet50-0676ba61.pth", substitute(
        "no weights file here: 'none' builds the ResNets without pretrained weights",
        {"/shared/resnet50-0676ba61.pth": "none"})),
    (".venv/bin/python -m domainbed_vasso.sweep launch --data_dir /shared/data --output_dir /shared/sweep "
     "--datasets PACS VLCS OfficeHome TerraIncognita --algorithms ERM SAM GSAM VASSO "
     "--hparams '{\"resnet50_augmix\": false, \"freeze_bn\": true}' --command_launcher slurm "
     "--skip_confirmation", check_only(SLURM, domainbed=True, expect=("--command_launcher",))),
    (".venv/bin/python -m domainbed_vasso.sweep status --output_dir /shared/sweep", check_only(
        SLURM, expect=("--output_dir",))),
    (".venv/bin/python -m domainbed_vasso.sweep delete_incomplete ... --skip_confirmation", check_only(
        "'...' stands for the launch's flags; " + SLURM, domainbed=True,
        check=".venv/bin/python -m domainbed_vasso.sweep delete_incomplete --help")),
    (".venv/bin/python -m domainbed_vasso.sweep launch ... --command_launcher slurm --skip_confirmation",
     check_only("'...' stands for the launch's flags; " + SLURM, domainbed=True,
                check=".venv/bin/python -m domainbed_vasso.sweep launch --command_launcher slurm --help")),
    (".venv/bin/vasso-domainbed-tables /shared/sweep", check_only(FINISHED_SWEEP)),
    ("DOMAINBED_ROOT=/path/to/DomainBed .venv/bin/python -m pytest tests/slurm", check_only(
        COLLECT_ONLY, domainbed=True,
        check="DOMAINBED_ROOT={DOMAINBED_ROOT} .venv/bin/python -m pytest -q --collect-only tests/slurm")),
    ("bash scripts/local_slurm.sh start", check_only(LOCAL_SLURM, check="bash -n scripts/local_slurm.sh")),
    ("export SLURM_CONF=/tmp/vasso-slurm-$UID/slurm.conf", run()),
    ("sinfo; srun -n2 hostname", check_only(LOCAL_SLURM, check="bash -n -c 'sinfo; srun -n2 hostname'")),
    ("bash scripts/local_slurm.sh status", check_only(LOCAL_SLURM, check="bash -n scripts/local_slurm.sh")),
    ("bash scripts/local_slurm.sh stop", check_only(LOCAL_SLURM, check="bash -n scripts/local_slurm.sh")),

    # ---- docs/fairseq.md
    # as documented, so that the BLEU it gives is docs/fairseq.md's (test_quick_start_bleu_is_the_documented_one)
    (QUICK_CORPUS, run()),
    (QUICK_PREPROCESS, run(needs=(QUICK_CORPUS,))),
    (QUICK_TRAIN, run(needs=(QUICK_PREPROCESS,), expect=("train_inner", "loss_gap=", "done training"),
                      timeout=1800)),
    (QUICK_BLEU, run(needs=(QUICK_TRAIN,), expect=("| vasso |", "sacreBLEU"))),
    ("srun .venv/bin/fairseq-train data-bin/iwslt14.tokenized.de-en --user-dir fairseq_vasso "
     "--distributed-world-size 16 --distributed-port 12345 --ddp-backend legacy_ddp --optimizer vasso "
     "--rho 0.1 --theta 0.4 ...", check_only(
        "a 16-GPU Slurm job ('...': the rest of the flags): fairseq-train parses its flags",
        check=".venv/bin/fairseq-train --user-dir fairseq_vasso --distributed-world-size 16 "
              "--distributed-port 12345 --ddp-backend legacy_ddp --optimizer vasso --rho 0.1 --theta 0.4 --help",
        expect=("--theta",))),
    (".venv/bin/torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $HEAD_NODE "
     "--master-port 12345 .venv/bin/fairseq-train data-bin/iwslt14.tokenized.de-en --user-dir fairseq_vasso "
     "--distributed-world-size 16 --optimizer vasso --rho 0.1 --theta 0.4 ...", check_only(
        "two 8-GPU nodes ('...': the rest of the flags): torchrun's and fairseq-train's flags parse",
        check=".venv/bin/torchrun --nnodes 2 --nproc-per-node 8 --help && .venv/bin/fairseq-train "
              "--user-dir fairseq_vasso --distributed-world-size 16 --optimizer vasso --rho 0.1 "
              "--theta 0.4 --help", expect=("--nproc-per-node", "--theta"))),
    (".venv/bin/fairseq-train data-bin/iwslt14.tokenized.de-en --user-dir fairseq_vasso --optimizer vasso "
     "--rho 0.1 --theta 0.4 --amp ...", check_only(
        "a GPU run ('...': the rest of the flags; fairseq's --amp needs CUDA, tests/fairseq runs it on a CPU "
        "scaler): fairseq-train parses its flags",
        check=".venv/bin/fairseq-train --user-dir fairseq_vasso --optimizer vasso --rho 0.1 --theta 0.4 --amp --help",
        expect=("--theta",))),
    ("export PYTHONWARNINGS='ignore:`torch.jit.script` is deprecated:FutureWarning,ignore:`torch.cuda.amp.custom_fwd"
     "(args...)` is deprecated:FutureWarning,ignore:`torch.cuda.amp.custom_bwd(args...)` is deprecated:FutureWarning'",
     run()),
    (".venv/bin/python -c 'import fairseq_vasso, os; print(os.path.dirname(fairseq_vasso.__file__))'",
     run(expect=("fairseq_vasso",))),
    (".venv/bin/python -m pytest -q tests/fairseq", check_only(
        COLLECT_ONLY, check=".venv/bin/python -m pytest -q --collect-only tests/fairseq")),

    # ---- docs/mixed_precision.md
    ('python: device = "cpu"', run(expect=("ascent_norm",))),  # both snippets: self-contained, on a CPU

    # ---- docs/translation.md
    (DEMO, substitute("the full demo takes 5 to 18 minutes", append=TINY_DEMO, timeout=600,
                      expect=("BLEU",))),
    (".venv/bin/python scripts/translation/iwslt14_prepare.py", check_only(
        "downloads the IWSLT-14 archive (tests/scripts runs every step after the download)")),
    (".venv/bin/python scripts/translation/iwslt14_recipe.py --dry-run", run(expect=("fairseq-train",))),
    (".venv/bin/python scripts/translation/iwslt14_recipe.py --seeds 1 2 3", check_only(
        "15 trainings of the paper's model on IWSLT-14: a GPU job")),
    (".venv/bin/vasso-bleu data-bin/iwslt14.tokenized.de-en --runs runs/iwslt14 "
     "--ref-file data/iwslt14.tokenized.de-en/tmp/test.en", substitute(
        "the demo's data, runs and references stand for IWSLT-14's",
        {"data-bin/iwslt14.tokenized.de-en": "runs/demo/data-bin", "runs/iwslt14": "runs/demo/runs",
         "data/iwslt14.tokenized.de-en/tmp/test.en": "runs/demo/tok/test.en"},
        append=" --generate-args='--max-len-a 1.2 --max-len-b 10'", needs=(DEMO,),
        expect=("sacreBLEU",))),
    (".venv/bin/python -m pytest -q tests/scripts", check_only(
        COLLECT_ONLY, check=".venv/bin/python -m pytest -q --collect-only tests/scripts")),
)


# ------------------------------------------------------------------ extraction

@dataclass
class Command:
    key: str          # the identity: normalized shell text, or "python: <first line>"
    text: str         # what runs: the shell text, or the snippet's code
    lang: str         # "sh" or "python"
    file: str         # relative to the repository
    line: int         # 1-based line of the command's first line

    @property
    def at(self):
        return f"{self.file}:{self.line}"


def code_blocks(text):
    """[(first line number, lang, [lines])] of the fenced and indented code blocks."""
    lines = text.split("\n")
    blocks, i = [], 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            indent = len(line) - len(stripped)
            lang = stripped[3:].strip().split(" ")[0].lower()
            j = i + 1
            while j < len(lines) and not lines[j].lstrip().startswith("```"):
                j += 1
            blocks.append((i + 2, lang, [raw[indent:] for raw in lines[i + 1:j]]))
            i = j + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            j = i
            while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                j += 1
            body = [raw[4:] for raw in lines[i:j]]
            while body and not body[-1].strip():
                body.pop()
            blocks.append((i + 1, "", body))
            i = j
            continue
        i += 1
    return blocks


def normalize_shell(line):
    """Drop a ``#`` comment and collapse blanks, both outside quotes."""
    out, quote, prev = [], None, " "
    for ch in line:
        if quote:
            out.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            out.append(ch)
        elif ch == "#" and prev in " \t":
            break
        elif ch in " \t":
            if out and out[-1] != " ":
                out.append(" ")
        else:
            out.append(ch)
        prev = ch
    return "".join(out).strip()


def _open_quote(text):
    """True when ``text`` ends inside a quoted string."""
    quote = None
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and not quote:
            break
    return quote is not None


def shell_commands(body):
    """[(offset of the first line, command)] of a shell block: a command goes on over a
    trailing backslash or an open quote."""
    commands, pending, start = [], [], None
    for offset, raw in enumerate(body):
        if not pending and not raw.strip():
            continue
        if not pending:
            start = offset
        code = raw.rstrip()
        if code.endswith("\\") and not normalize_shell(code).startswith("#"):
            pending.append(code[:-1])
            continue
        pending.append(code)
        if _open_quote(" ".join(p.strip() for p in pending)):
            continue
        command = normalize_shell(" ".join(p.strip() for p in pending))
        pending = []
        if command:
            commands.append((start, command))
    return commands


def extract(files=DOC_FILES):
    """Every documented command, in document order."""
    out = []
    for rel in files:
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        for first, lang, body in code_blocks(text):
            if lang in OUTPUT_LANGS:
                continue
            if lang in ("python", "py", "python3"):
                code = "\n".join(body).strip("\n")
                head = next((normalize_shell(l) for l in body if normalize_shell(l)), "")
                out.append(Command(f"python: {head}", code + "\n", "python", rel, first))
                continue
            for offset, command in shell_commands(body):
                out.append(Command(command, command, "sh", rel, first + offset))
    return out


DOCUMENTED = extract()


# ------------------------------------------------------------------ running

def _venv():
    return sys.prefix


def make_workspace(ws, repo=REPO):
    """Copies what a clone of ``repo`` holds into the folder ``ws`` (copies, not links: a
    command that writes to a documented path writes into the workspace) and links ``.venv``."""
    copy_clone(ws, repo)
    os.symlink(_venv(), os.path.join(ws, ".venv"))


# Where the documented commands write by default in a checkout: a user's finished results
# (runs/demo holds twenty minutes of the demo). The suite must leave them alone, and it only
# reads them: nothing of this suite writes into the checkout, not even a stand-in (an
# interrupted session would leave it behind, where the user's next command finds it).
USER_RESULTS = ("runs/demo", "runs/quickstart")


def tree_digest(path):
    """sha256 over every file of the tree at ``path`` (relative names and bytes; a file's
    bytes), or None."""
    if not os.path.exists(path):
        return None
    h = hashlib.sha256()
    if os.path.isfile(path):
        with open(path, "rb") as f:
            h.update(f.read())
        return h.hexdigest()
    for top, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(top, name)
            h.update(os.path.relpath(full, path).encode() + b"\0")
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


@pytest.fixture(scope="session")
def users_results():
    """Each of USER_RESULTS in the checkout, read only: byte for byte the same after the whole
    suite as before it, and absent after it where it was absent before (a fresh clone, CI)."""
    before = {rel: tree_digest(os.path.join(REPO, rel)) for rel in USER_RESULTS}
    yield before
    after = {rel: tree_digest(os.path.join(REPO, rel)) for rel in USER_RESULTS}
    changed = [rel for rel in USER_RESULTS if after[rel] != before[rel]]
    assert not changed, ("the docs suite wrote, changed or removed results in the checkout (it must write only "
                         "in its workspace): " + ", ".join(os.path.join(REPO, rel) for rel in changed))


@pytest.fixture(scope="session")
def workspace(tmp_path_factory, request, users_results):
    """A folder that looks like a fresh clone after the README's setup."""
    ws = tmp_path_factory.mktemp("docs-workspace")
    make_workspace(str(ws))
    ws = str(ws)
    _STATUS_BEFORE.append(git_status())
    # queue every selected test's command now (see _POOL), as chains (_chains): first those
    # that others need (the quick start, the demo: the longest), then the other commands that
    # run, then the checks
    selected = [item.callspec.params["cmd"] for item in request.session.items
                if "cmd" in getattr(getattr(item, "callspec", None), "params", {})]
    interrupt = _SIGTERM_AS_INTERRUPT()
    try:
        for chain in _chains(selected):
            _submit_chain(chain, ws)
        yield ws
    finally:
        # also on Ctrl-C (pytest tears the session fixtures down then): the queued commands
        # never start, the running ones are killed with their groups
        stop_commands()
        interrupt.restore()


def command_env():
    env = dict(os.environ)
    venv_bin = os.path.join(_venv(), "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    for name in ("VIRTUAL_ENV", "DOMAINBED_ROOT", "PYTHONHOME"):
        env.pop(name, None)
    # the code under test is this checkout (the venv's editable install may point elsewhere)
    env["PYTHONPATH"] = REPO
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env["DOMAINBED_VASSO_NUM_WORKERS"] = "0"
    # on the CPU wherever the suite runs: the numbers the docs state were measured there (the quick
    # start's BLEU: "Quick start on a CPU"), and a GPU would round otherwise (tests/helpers/cpu_only.py)
    return cpu_only.env(env)


def fill(text):
    return text.replace("{DOMAINBED_ROOT}", DOMAINBED or "/nonexistent/DomainBed")


def as_run(cmd, how):
    """The shell text that runs for ``cmd`` classified as ``how``."""
    if how.kind == "check":
        if how.check is not None:
            return fill(how.check)
        return cmd.text + " --help"
    text = cmd.text
    for old, new in how.replace:
        text = text.replace(old, fill(new))
    if cmd.lang == "python":
        code = how.prelude + text + how.append
        return ".venv/bin/python - <<'DOCS_SNIPPET_EOF'\n" + code + "DOCS_SNIPPET_EOF"
    return text + fill(how.append)


def exports_before(cmd):
    """The shell text of the export lines of ``cmd``'s file that come before it."""
    lines = []
    for other in DOCUMENTED:
        if other.file == cmd.file and other.lang == "sh" and other.line < cmd.line:
            if other.text.startswith("export ") and other.key in COMMANDS:
                how = COMMANDS[other.key]
                if how.domainbed and DOMAINBED is None:
                    continue
                lines.append(as_run(other, how))
    return lines


def git_status():
    """``git status --porcelain`` of the repository, every untracked file listed."""
    return subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True).stdout


_STATUS_BEFORE = []  # the repository's status when the workspace was made


# Every script runs once per session, on a pool as wide as CI's machine (2 cores): every
# selected command is queued at the first command test (_chains: a command that needs another
# runs after it, on the same thread), so that the pool's two threads stay busy to the end.
# stop_commands() ends the pool: what is queued is cancelled, what runs is killed (its whole
# process group, by id), and nothing starts after it (a worker that was about to start a
# command finds _STOPPED set under the same lock).
_POOL = ThreadPoolExecutor(max_workers=2)
_DONE = {}
_RUNNING = set()  # the commands' processes now running (each leads its own process group)
_LOCK = threading.Lock()
_STOPPED = threading.Event()


def stop_commands():
    """Cancel the queued commands and kill the running ones' process groups; returns at once
    (the pool's threads end as soon as their command is killed)."""
    with _LOCK:
        _STOPPED.set()
        running = list(_RUNNING)
    _POOL.shutdown(wait=False, cancel_futures=True)
    for future in list(_DONE.values()):  # a chain's later commands, whose chain never started
        future.cancel()
    for proc in running:
        process_group.kill_group(proc)
    _POOL.shutdown(wait=True)


class _SIGTERM_AS_INTERRUPT:
    """While the workspace lives, SIGTERM (``timeout``, a CI runner) interrupts the session as
    Ctrl-C does, so the fixtures' teardown stops the commands instead of leaving them running."""

    def __init__(self):
        self.previous = None
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self.previous = signal.signal(signal.SIGTERM, self._interrupt)

    @staticmethod
    def _interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def restore(self):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _temp_dir(workspace):
    """The commands' TMPDIR, beside the workspace in the test's own temporary folder: what they
    leave in a temporary folder (torchrun's torchelastic_* logs) does not land in the system's."""
    path = workspace.rstrip(os.sep) + "-tmp"
    os.makedirs(path, exist_ok=True)
    return path


def _run_script(script, workspace, timeout):
    """(exit status or a timeout note, output) of ``bash -c script``; on a timeout, an
    interrupt or stop_commands() the whole process group (fairseq-train's children included)
    is killed, by its id.  The output goes to an unnamed temporary file, not a pipe: the wait
    ends when bash does, even where something it started in a session of its own still holds
    the output open (a pipe's reader would wait for that too, and stop_commands() with it)."""
    with tempfile.TemporaryFile() as output:
        with _LOCK:
            if _STOPPED.is_set():
                return "not run: the session was stopped", ""
            proc = process_group.popen(["bash", "-c", script], cwd=workspace,
                                       env=dict(command_env(), TMPDIR=_temp_dir(workspace)),
                                       stdout=output, stderr=subprocess.STDOUT)
            _RUNNING.add(proc)
        try:
            proc.wait(timeout=timeout)
            status = proc.returncode
        except subprocess.TimeoutExpired:
            status = f"timeout after {timeout} s"
        finally:
            process_group.kill_group(proc)  # what it left running in its group, or all of it
            proc.wait()
            with _LOCK:
                _RUNNING.discard(proc)
        output.seek(0)
        return status, output.read().decode(errors="replace")


def _script(cmd):
    pin = QUICK_PIN if cmd.key in QUICK_START else []
    return "\n".join(["set -e"] + exports_before(cmd) + pin + [as_run(cmd, COMMANDS[cmd.key])])


def _submit(cmd, workspace):
    how = COMMANDS[cmd.key]
    script = _script(cmd)
    if (workspace, script) not in _DONE:
        _DONE[workspace, script] = _POOL.submit(
            lambda: (script,) + _run_script(script, workspace, how.timeout))
    return _DONE[workspace, script]


def _chains(cmds):
    """``cmds`` and the commands they need, each once, as lists that run one after the other:
    a command that others need heads a chain of itself, then (depth first, in document order)
    those that need it; a chain starts with its needs done (a command needs at most one, see
    test_substitutions_and_needs_still_match). Chains with dependents come first (the
    quick start's training and the demo are the longest commands: started first, each on one
    of the pool's threads, they run beside everything else), then the other commands that
    run, then the checks. The commands that need a DomainBed this session lacks are left
    out (their tests skip)."""
    wanted, pending = [], list(cmds)
    while pending:
        cmd = pending.pop(0)
        if not any(cmd is w for w in wanted):
            wanted.append(cmd)
            pending += [d for need in COMMANDS[cmd.key].needs for d in DOCUMENTED if d.key == need][:1]
    wanted = [c for c in DOCUMENTED if any(c is w for w in wanted)
              and not (COMMANDS[c.key].domainbed and DOMAINBED is None)]
    dependents = {}
    for c in wanted:
        for need in COMMANDS[c.key].needs:
            dependents.setdefault(need, []).append(c)
    roots = [c for c in wanted if not COMMANDS[c.key].needs]
    led = [c for c in roots if c.key in dependents]

    def chain(c):  # each dependent once, after the first command of the key it needs
        return [c] + [d for dep in dependents.pop(c.key, []) for d in chain(dep)]

    heads = [chain(c) for c in led]
    runs = [[c] for c in roots if c not in led and COMMANDS[c.key].kind != "check"]
    checks = [[c] for c in roots if c not in led and COMMANDS[c.key].kind == "check"]
    return heads + runs + checks


def _submit_chain(chain, workspace):
    """Queues ``chain`` (of _chains) as one job of the pool: its commands run one after the
    other, each memoized as _submit memoizes it (a script queued already, by another chain,
    is waited for, not run again); a command whose need failed is not run (its test says
    which need failed)."""
    steps, own = [], False
    for cmd in chain:
        script = _script(cmd)
        mine = (workspace, script) not in _DONE
        if mine:
            _DONE[workspace, script] = Future()
        steps.append((cmd, script, _DONE[workspace, script], mine))
        own = own or mine
    if not own:
        return

    def job():
        failed = {}  # key: where, of the commands of this chain that failed or were not run
        for cmd, script, future, mine in steps:
            need = next((n for n in COMMANDS[cmd.key].needs if n in failed), None)
            if not mine:  # queued before this chain: done, or running on the other thread
                try:
                    ok = future.result()[1] == 0
                except BaseException:  # noqa: B902 (cancelled or failed: its test reports it)
                    ok = False
                if not ok:
                    failed[cmd.key] = cmd.at
            elif not future.set_running_or_notify_cancel():  # cancelled by stop_commands()
                failed[cmd.key] = cmd.at
            elif need is not None:
                failed[cmd.key] = cmd.at
                future.set_result((script, f"not run: {failed[need]}, which it needs, failed", ""))
            else:
                try:
                    result = (script,) + _run_script(script, workspace, COMMANDS[cmd.key].timeout)
                except BaseException as exc:  # noqa: B902 (handed to the test that waits for it)
                    future.set_exception(exc)
                    failed[cmd.key] = cmd.at
                    continue
                future.set_result(result)
                if result[1] != 0:
                    failed[cmd.key] = cmd.at
    _POOL.submit(job)


def execute(cmd, workspace):
    """Run ``cmd`` (its classification decides how); returns (script, rc, output). Memoized."""
    how = COMMANDS[cmd.key]
    for need in how.needs:
        first = next((c for c in DOCUMENTED if c.key == need), None)
        assert first is not None, f"{cmd.at}: needs {need!r}, which no doc holds any more"
        _, rc, out = execute(first, workspace)
        assert rc == 0, f"{cmd.at} needs {first.at} ({need}), which failed:\n{out[-3000:]}"
    return _submit(cmd, workspace).result()


# ------------------------------------------------------------------ the tests

def test_docs_hold_commands():
    # the extraction itself: a change of the docs' markup must not make them look empty
    assert len(DOCUMENTED) >= 20
    assert any(c.text.startswith(".venv/bin/fairseq-train ") for c in DOCUMENTED)


def test_every_documented_command_is_classified():
    missing = [c for c in DOCUMENTED if c.key not in COMMANDS]
    if missing:
        lines = [f"{len(missing)} documented command(s) not classified in COMMANDS of {__file__}:"]
        for c in missing:
            lines.append(f"  {c.at}: {c.key}")
        lines.append("Add an entry for each (run(), substitute(why, {...}) or check_only(why)), e.g.:")
        for key in dict.fromkeys(c.key for c in missing):
            lines.append(f"    ({key!r}, check_only('WHY')),")
        pytest.fail("\n".join(lines))


def test_every_classified_command_is_still_documented():
    documented = {c.key for c in DOCUMENTED}
    stale = [k for k in COMMANDS if k not in documented]
    assert not stale, ("COMMANDS classifies commands that no doc holds any more (remove them, or "
                       "update them to the docs' new text):\n  " + "\n  ".join(stale))


def test_substitutions_and_needs_still_match():
    problems = []
    for c in DOCUMENTED:
        how = COMMANDS.get(c.key)
        if how is None:
            continue
        for old, _ in how.replace:
            if old not in c.text:
                problems.append(f"{c.at}: replacement {old!r} no longer occurs in: {c.key}")
        for need in how.needs:
            if need not in COMMANDS or not any(d.key == need for d in DOCUMENTED):
                problems.append(f"{c.at}: needs {need!r}, which is not a classified, documented command")
        if len(how.needs) > 1:  # a command runs in the chain of the one it needs (_chains)
            problems.append(f"{c.at}: needs more than one command: {c.key}")
        if how.kind != "run" and not how.why:
            problems.append(f"{c.at}: {how.kind} without a reason: {c.key}")
        if how.kind == "check" and how.check is None and (" && " in c.text or c.lang == "python"):
            problems.append(f"{c.at}: check_only needs an explicit check for: {c.key}")
    assert not problems, "\n".join(problems)


# the programs a documented shell command may start with: the environment's, spelled out
_ALLOWED_PROGRAMS = {"bash", "git", "export", "source", "cd", "test", "mkdir", "ls", "cat",
                     "srun", "sinfo", "squeue", "sbatch"}


def _programs(text):
    """The program of each simple command in ``text`` (after VAR=value assignments)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    programs, words, redirect = [], [], False
    for token in list(lexer) + [";"]:
        if token and set(token) <= set("<>"):
            redirect = True                  # the next word is a file, not an argument
        elif token and set(token) <= set(";&|()"):
            while words and "=" in words[0] and not words[0].startswith(("-", "=")):
                words = words[1:]
            if words:
                programs.append(words[0])
            words = []
        elif redirect:
            redirect = False
        else:
            words.append(token)
    return programs


def test_every_command_names_the_environment():
    # item: "Commands assume an activated .venv and never say so"
    bad = []
    for c in DOCUMENTED:
        if c.lang != "sh":
            continue
        for program in _programs(c.text):
            if program.startswith(".venv/bin/") or program in _ALLOWED_PROGRAMS:
                continue
            bad.append(f"{c.at}: {program!r} in: {c.text}")
    assert not bad, ("documented commands whose program is not spelled with the environment "
                     "(.venv/bin/...), so a newcomer without an activated .venv gets "
                     "'command not found' or the system Python:\n  " + "\n  ".join(bad))


def _params():
    params = []
    for c in DOCUMENTED:
        if c.key in COMMANDS:
            params.append(pytest.param(c, id=c.at))
    return params


@pytest.mark.parametrize("cmd", _params())
def test_documented_command(cmd, workspace):
    how = COMMANDS[cmd.key]
    if how.domainbed and DOMAINBED is None:
        from domainbed_vasso._locate import NOT_IMPORTABLE
        pytest.skip(NOT_IMPORTABLE)
    script, rc, out = execute(cmd, workspace)
    label = {"run": "run as written", "substitute": f"run with substitutions ({how.why})",
             "check": f"checked only ({how.why})"}[how.kind]
    assert rc == 0, (f"documented command failed: {cmd.at}\n  as documented: {cmd.key}\n  {label}; ran:\n"
                     f"{script}\n  exit status {rc}; last output:\n{out[-4000:]}")
    for needle in how.expect:
        assert needle in out, (f"{cmd.at}: the output of\n{script}\nlacks {needle!r}; last output:\n"
                               f"{out[-4000:]}")


def test_workspace_holds_a_copy_of_what_a_clone_holds(tmp_path):
    # the workspace copies tracked and new unignored files, never an ignored output folder,
    # so a documented command's output (runs/...) cannot reach the user's
    repo, ws = tmp_path / "repo", tmp_path / "ws"
    (repo / "scripts").mkdir(parents=True)
    (repo / "runs" / "demo").mkdir(parents=True)
    (repo / ".gitignore").write_text("/runs/\n")
    (repo / "scripts" / "tracked.py").write_text("print(1)\n")
    (repo / "new_doc.md").write_text("new\n")
    (repo / "runs" / "demo" / "results.md").write_text("the user's table\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", ".gitignore", "scripts/tracked.py"], check=True)
    ws.mkdir()
    make_workspace(str(ws), str(repo))
    assert sorted(os.listdir(ws)) == [".gitignore", ".venv", "new_doc.md", "scripts"]
    assert not os.path.islink(ws / "scripts") and not os.path.islink(ws / "scripts" / "tracked.py")
    (ws / "scripts" / "tracked.py").write_text("changed in the workspace\n")
    assert (repo / "scripts" / "tracked.py").read_text() == "print(1)\n"


def test_quick_start_runs_again(workspace):
    # docs/fairseq.md says the quick start can be run again as it stands: its second run,
    # in the same workspace after the first, succeeds; the corpus is not rewritten, the
    # preprocessing is skipped, the finished training is left as it is, and scoring writes
    # a new folder
    first = [next(c for c in DOCUMENTED if c.key == key) for key in QUICK_START]
    for cmd in first:
        _, rc, out = execute(cmd, workspace)
        assert rc == 0, f"{cmd.at} failed the first time:\n{out[-3000:]}"
    dict_file = os.path.join(workspace, "runs", "quickstart", "data-bin", "dict.en.txt")
    raw_file = os.path.join(workspace, "runs", "quickstart", "raw", "train.de")
    ckpt = os.path.join(workspace, "runs", "quickstart", "vasso", "seed1", "checkpoint_last.pt")
    stamps = (os.stat(dict_file).st_mtime_ns, os.stat(raw_file).st_mtime_ns, tree_digest(ckpt))
    script = "\n".join(["set -e"] + QUICK_PIN + [as_run(c, COMMANDS[c.key]) for c in first])
    rc, out = _run_script(script, workspace, 600)
    assert rc == 0, f"the quick start failed when run a second time:\n{script}\n{out[-4000:]}"
    assert "already holds this corpus" in out and "trained already, nothing to do" in out and "| vasso |" in out
    assert (os.stat(dict_file).st_mtime_ns, os.stat(raw_file).st_mtime_ns, tree_digest(ckpt)) == stamps
    generated = glob.glob(os.path.join(workspace, "runs", "quickstart", "vasso", "seed1", "generate-test*"))
    assert len(generated) == 2, generated


def test_the_distributed_example_warns_of_nothing_and_refuses_a_used_out_once(workspace):
    # docs/distributed.md's command: its run prints no warning of torch's about reading a tensor
    # that requires grad; run again into the same --out, it is refused once (by rank 0, before
    # any process group exists), and no rank starts work
    cmd = next(c for c in DOCUMENTED if c.key == DIST_EXAMPLE)
    _, rc, out = execute(cmd, workspace)
    assert rc == 0 and "identical" in out, out[-3000:]
    assert "requires_grad=True to a scalar" not in out and "Warning" not in out, out[-3000:]
    rc, again = _run_script(as_run(cmd, COMMANDS[cmd.key]), workspace, 300)
    assert rc != 0 and again.count("exists and is not empty") == 1, again[-3000:]
    assert "ddp " not in again and 'distributed_example.py", line' not in again, again[-3000:]  # no work, no traceback of ours


def _processes_in(folder):
    """{pid: command line} of the processes whose working directory is in ``folder``."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found_cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone, a zombie, or another user's
            continue
        if cwd == folder or cwd.startswith(folder + os.sep):
            found[int(pid)] = found_cmd
    return found


def _group_of(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


# pytest with Ctrl-C handled as Python's default (see the test below), its arguments after -c's
_PYTEST_WITH_CTRL_C = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "sys.exit(pytest.main(sys.argv[1:]))")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the commands' processes in /proc")
def test_an_interrupted_docs_suite_stops_at_once_and_leaves_the_checkout_as_it_was(tmp_path):
    # Ctrl-C (SIGINT to the suite's process group, as a terminal sends it) while documented
    # commands run and others wait in the queue: pytest ends within seconds (not when the
    # running demo ends, minutes later), no command runs on after it, and `git status --ignored` of the checkout the suite ran in (a copy of
    # this one, a git repository of its own) shows nothing new
    repo, base, log = tmp_path / "repo", tmp_path / "basetemp", tmp_path / "suite.log"
    copy_clone(str(repo))
    os.symlink(_venv(), repo / ".venv")
    git = ["git", "-C", str(repo)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)

    def status():
        return subprocess.run(git + ["status", "--ignored", "--porcelain", "--untracked-files=all"],
                              capture_output=True, text=True, check=True).stdout
    before = status()
    # a plot of the demo's runs: the (tiny) demo, minutes long, is queued first, then four
    # checks, on the pool of two; the suite is interrupted while the demo runs
    plot = next(c for c in DOCUMENTED if COMMANDS.get(c.key, run()).needs == (DEMO,))
    checks = [c for c in DOCUMENTED if c.key in COMMANDS and COMMANDS[c.key].kind == "check"
              and not COMMANDS[c.key].domainbed][:4]
    nodes = [f"tests/docs/test_docs_commands.py::test_documented_command[{c.at}]" for c in checks + [plot]]
    env = {k: v for k, v in os.environ.items() if k not in ("DOMAINBED_ROOT", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1")
    with open(log, "w") as out:
        # Ctrl-C's default handling, as a terminal gives it: a process started in the background
        # of a script (`cmd &`, which some CI runners do) inherits SIGINT ignored, and Python
        # then installs no KeyboardInterrupt handler
        suite = process_group.popen([sys.executable, "-c", _PYTEST_WITH_CTRL_C, "-q", "-p", "no:cacheprovider",
                                     f"--basetemp={base}", *nodes], cwd=repo, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
    left = {}
    try:
        running, own = {}, None
        while not running and suite.poll() is None:  # until a documented command runs
            threading.Event().wait(0.05)
            found = _processes_in(str(base))
            own = found.get(suite.pid, own)
            # a command leads a process group of its own (a child still between fork and exec
            # shows the suite's command line)
            running = {pid: cmd for pid, cmd in found.items() if pid != suite.pid and cmd != own
                       and _group_of(pid) == pid and "scripts/translation/demo.py" in cmd}
        assert running, f"the suite ended before the demo ran:\n{log.read_text()[-3000:]}"
        os.killpg(suite.pid, signal.SIGINT)
        try:
            suite.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # where each of its threads waits: pytest's faulthandler dumps them on SIGABRT
            os.kill(suite.pid, signal.SIGABRT)
            try:
                suite.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            pytest.fail(f"the suite ran on for 30 s after Ctrl-C; the processes in its folder: "
                        f"{_processes_in(str(base))}; its log:\n{log.read_text()[-6000:]}")
        for _ in range(50):  # SIGKILL is delivered at once, but not synchronously
            left = _processes_in(str(base))
            if not left:
                break
            suite.poll()
            threading.Event().wait(0.1)
        assert not left, f"commands ran on after the suite stopped: {left}"
        assert "KeyboardInterrupt" in log.read_text(), log.read_text()[-3000:]  # stopped mid-way
        assert status() == before, f"git status --ignored changed:\n{before}\n---\n{status()}"
    finally:
        process_group.kill_group(suite)
        suite.wait()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_quick_start_bleu_is_the_documented_one(workspace):
    # docs/fairseq.md states the quick start's test BLEU with the CPU kernels pinned by the line it
    # gives: the quick start as documented after that line gives exactly those numbers, or the doc is
    # stale. Where the kernels cannot be pinned (another architecture, a CPU without AVX2) or the CPU
    # is not of the vendor the numbers were measured on (pinned_kernels.unmeasured), the digits may
    # differ, and the test checks what the doc says of them: the pipeline learns (BLEU above 50)
    text = _doc_text("docs/fairseq.md")
    stated = re.search(r"the test BLEU was (\d+\.\d\d) \(fairseq\) and (\d+\.\d\d) \(sacreBLEU\)", text)
    assert stated, "docs/fairseq.md no longer states the quick start's test BLEU in the form this test reads"
    stated_torch = re.search(r"With torch (\d+\.\d+\.\d+) and the CPU kernels pinned", text)
    assert stated_torch, "docs/fairseq.md no longer names the torch of its quick start BLEU in the form this test reads"
    pin = re.search(r"`(export ATEN_CPU_CAPABILITY=[^`]*)`", text)
    assert pin and pin.group(1) == pinned_kernels.EXPORT, (
        f"docs/fairseq.md must give the line that pins the CPU kernels, `{pinned_kernels.EXPORT}` "
        f"(plugins/lab/pinned_kernels.py), as the tests run it; it gives {pin and pin.group(1)!r}")
    cmd = next(c for c in DOCUMENTED if c.key == QUICK_BLEU)
    _, rc, out = execute(cmd, workspace)
    assert rc == 0, out[-3000:]
    got = re.search(r"fairseq BLEU (\d+\.\d\d), sacreBLEU (\d+\.\d\d)", out)
    assert got, out[-3000:]
    import torch

    exact = pinned_kernels.unmeasured() is None and torch.__version__.split("+")[0] == stated_torch.group(1)
    if QUICK_PIN and exact:
        assert got.groups() == stated.groups(), (
            f"with the CPU kernels pinned, the quick start gives test BLEU {got.group(1)} (fairseq) and "
            f"{got.group(2)} (sacreBLEU), docs/fairseq.md says {stated.group(1)} and {stated.group(2)}: "
            "re-measure and update the doc")
    else:
        assert min(map(float, got.groups())) > 50, (
            f"the quick start gives test BLEU {got.group(1)} (fairseq) and {got.group(2)} (sacreBLEU): the "
            "pipeline did not learn (the doc's exact numbers are for torch %s with the CPU kernels pinned; this is "
            "torch %s, %s)" % (stated_torch.group(1), torch.__version__,
                               pinned_kernels.unmeasured() or "the kernels pinned"))
    # vasso-bleu's fairseq-generate (its log beside the checkpoint) gets the plugin's filter of the
    # FutureWarnings that importing fairseq prints
    logs = glob.glob(os.path.join(workspace, "runs", "quickstart", "vasso", "seed1", "generate-test*", "generate.log"))
    assert logs, out[-3000:]
    for log in logs:
        with open(log, encoding="utf-8") as f:
            text = f.read()
        assert "FutureWarning" not in text, f"{log}:\n{text[:3000]}"


# fairseq-train's weights after QUICK_PIN_UPDATES updates of the quick start (its model, data and
# flags) with the CPU kernels pinned (plugins.lab.pinned_kernels), torch 2.14.1: sha256 over the
# checkpoint's tensors (_WEIGHTS_DIGEST)
QUICK_PIN_UPDATES = 3
QUICK_PIN_TORCH = "2.14.1"
QUICK_PIN_DIGEST = "69d98a76a5a51d8ee20616f1a63759bf5e65a20026358bbdeab0be833823a78d"
_WEIGHTS_DIGEST = """.venv/bin/python - <<'EOF'
import hashlib, torch
state = torch.load("{ckpt}", map_location="cpu", weights_only=False)["model"]
digest = hashlib.sha256()
for name in sorted(state):
    digest.update(name.encode() + state[name].contiguous().numpy().tobytes())
print("capability", torch.backends.cpu.get_cpu_capability(), "weights", digest.hexdigest())
EOF"""


def _quick_start_updates(workspace, name, exports):
    """(torch's CPU capability, sha256 of the weights) after QUICK_PIN_UPDATES updates of the quick
    start's fairseq-train, run after ``exports`` (shell lines) into runs/quickstart/pinning/NAME."""
    save = f"runs/quickstart/pinning/{name}"
    train = QUICK_TRAIN.replace("--max-update 300", f"--max-update {QUICK_PIN_UPDATES}").replace(
        "--save-dir runs/quickstart/vasso/seed1", f"--save-dir {save}")
    assert train != QUICK_TRAIN and save in train
    script = "\n".join(["set -e", f"rm -rf {save}"] + exports + [train, _WEIGHTS_DIGEST.format(
        ckpt=f"{save}/checkpoint_last.pt")])
    rc, out = _run_script(script, workspace, 900)
    found = re.search(r"^capability (\w+) weights ([0-9a-f]{64})$", out, re.M)
    assert rc == 0 and found, f"{name}: {rc}\n{script}\n{out[-3000:]}"
    return found.groups()


def test_pinned_kernels_decide_the_quick_starts_numbers(workspace, capsys):
    # the pin itself, on the quick start's model: a few updates pinned give the pinned weights bit for
    # bit on the CPUs of the vendor they were measured on, and beside them a run on other kernels: this CPU's own where it
    # has more than AVX2 (AVX512: pinning changes the numbers, or changes nothing here), else torch's
    # DEFAULT kernels (lower than the pin: they must differ, or ATEN_CPU_CAPABILITY did not reach torch)
    import torch

    why = pinned_kernels.unmeasured()
    if why is not None:
        pytest.skip(f"the pinned weights do not apply here: {why}")
    if torch.__version__.split("+")[0] != QUICK_PIN_TORCH:
        pytest.skip(f"the pinned weights are torch {QUICK_PIN_TORCH}'s; this is torch {torch.__version__}")
    prep = next(c for c in DOCUMENTED if c.key == QUICK_PREPROCESS)
    _, rc, out = execute(prep, workspace)
    assert rc == 0, out[-3000:]
    native = pinned_kernels.capability(pinned_kernels.unpinned_env(command_env()))
    pinned = _quick_start_updates(workspace, "pinned", QUICK_PIN)
    if native == pinned_kernels.CAPABILITY:
        lower = pinned_kernels.EXPORT.replace("ATEN_CPU_CAPABILITY=avx2", "ATEN_CPU_CAPABILITY=default")
        other_name, other = "DEFAULT", _quick_start_updates(workspace, "default", [lower])
    else:
        other_name, other = f"this CPU's own ({native})", _quick_start_updates(
            workspace, "native", ["unset " + " ".join(pinned_kernels.PINNED)])
    assert pinned == (pinned_kernels.CAPABILITY, QUICK_PIN_DIGEST), (
        f"{QUICK_PIN_UPDATES} updates of the quick start with the kernels pinned gave {pinned}, not the pinned "
        f"({pinned_kernels.CAPABILITY}, {QUICK_PIN_DIGEST}): the pin does not reproduce them on this CPU")
    if native == pinned_kernels.CAPABILITY:
        assert other[0] == "DEFAULT" and other[1] != pinned[1], (
            f"torch's DEFAULT kernels gave the pinned weights bit for bit ({other}): the pin shows no effect")
        verdict = ("torch's own kernels on this CPU are the pinned capability (AVX2); pinned lower (DEFAULT), the "
                   "weights differ: the pin reaches torch's kernels")
    else:
        assert other[0] == native
        verdict = (f"this CPU's own kernels ({native}) give " + (
            "the same weights: pinning changes nothing on this machine" if other[1] == pinned[1] else
            "other weights: pinning makes this machine give the pinned numbers"))
    with capsys.disabled():
        print(f"\npinned kernels: {QUICK_PIN_UPDATES} updates of the quick start pinned ({pinned_kernels.EXPORT}) "
              f"give the pinned weights bit for bit; {verdict} ({other_name}: {other[1][:16]}...)")


def test_no_documented_command_uses_sudo():
    # a newcomer may have no sudo: what needs root is said in prose (docs/domainbed.md)
    bad = [f"{c.at}: {c.text}" for c in DOCUMENTED if c.lang == "sh" and "sudo" in shlex.split(c.text, comments=True)]
    bad += [f"{rel}: `{span}`" for rel in DOC_FILES for span in _code_spans(rel) if "sudo" in span.split()]
    assert not bad, "documented commands that use sudo:\n  " + "\n  ".join(bad)


# ------------------------------------------------------------------ the paths the prose names

_LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
_STRIP = "\"'.,;:()[]"


def _doc_text(rel):
    with open(os.path.join(REPO, rel), encoding="utf-8") as f:
        return f.read()


def _prose(rel):
    """The doc's text with its code blocks (fenced or indented, fences included) blanked."""
    lines = _doc_text(rel).split("\n")
    for first, _lang, body in code_blocks("\n".join(lines)):
        start, end = first - 1, first - 1 + len(body)  # 0-based, the body
        if start > 0 and lines[start - 1].lstrip().startswith("```"):
            start, end = start - 1, end + 1  # the fences
        for i in range(start, min(end, len(lines))):
            lines[i] = ""
    return "\n".join(lines)


def _code_spans(rel):
    return [m.group(2).strip() for m in _SPAN.finditer(_prose(rel))]


def _top_level():
    """The names at the top of the repository that a clone holds (tracked, or new and not ignored)."""
    names = set()
    for name in os.listdir(REPO):
        if name == ".git" or os.path.islink(os.path.join(REPO, name)):  # .venv in a worktree
            continue
        path = name + "/" if os.path.isdir(os.path.join(REPO, name)) else name
        if subprocess.run(["git", "-C", REPO, "check-ignore", "-q", "--no-index", "--", path]).returncode == 1:
            names.add(name)
    return names


def repository_paths(rel, top=None):
    """[(path relative to the repository, how it was named)] of ``rel``: every markdown link
    target that is not a URL or an anchor (relative to the doc's folder), and every word in
    a code span or a command block that starts with a top-level entry of the repository
    followed by ``/`` (relative to the repository root, where the docs' commands run), or is
    one of its top-level files. Words holding placeholders (``<...>``, ``*``, ``{...}``, ``$``,
    ``...``) are patterns, not paths."""
    top = _top_level() if top is None else top
    found = []
    text = _doc_text(rel)
    for m in _LINK.finditer(_prose(rel)):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        found.append((os.path.normpath(os.path.join(os.path.dirname(rel), target)), f"link ({m.group(1)})"))
    words = [(w, "`" + span + "`") for span in _code_spans(rel) for w in span.split()]
    for first, lang, body in code_blocks(text):
        if lang not in OUTPUT_LANGS:
            words += [(w, f"code block at {rel}:{first}") for line in body for w in line.split()]
    for word, where in words:
        word = word.split("=", 1)[-1] if word.startswith("--") else word  # --flag=path
        word = word.strip(_STRIP)
        if word.startswith("./"):
            word = word[2:]
        if not word or any(mark in word for mark in ("<", ">", "*", "{", "}", "$", "...", "?", "|")):
            continue
        head = word.split("/")[0]
        if head in top and ("/" in word or not os.path.isdir(os.path.join(REPO, head))):
            found.append((os.path.normpath(word), where))
    return found


def test_path_extraction_finds_links_spans_and_commands(tmp_path, monkeypatch):
    doc = ("See [the design](design.md#6-rho) and ![a plot](img/x.png), [a site](https://example.org).\n"
           "Run `.venv/bin/python scripts/translation/demo.py --out runs/x`, or read `plugins/optimizer.py:12`,\n"
           "`setup.cfg`, `plugins.plot` and `docs/digits/*.json`.\n\n"
           "    bash scripts/digits/digits_sweep.sh sweep/digits   # scripts/in_a_comment.sh\n\n"
           "```text\nscripts/only_output.py\n```\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(doc)
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    found = [path for path, _ in repository_paths("docs/page.md", top={"scripts", "plugins", "docs", "setup.cfg"})]
    assert found == ["docs/design.md", "docs/img/x.png", "scripts/translation/demo.py", "plugins/optimizer.py:12",
                     "setup.cfg", "scripts/digits/digits_sweep.sh", "scripts/in_a_comment.sh"]


def test_every_repository_path_the_docs_name_exists():
    top = _top_level()
    missing = []
    for rel in DOC_FILES:
        for path, where in repository_paths(rel, top):
            path = re.sub(r":\d+$", "", path)  # file:line
            if not os.path.exists(os.path.join(REPO, path)):
                missing.append(f"{rel}: {path} (named in {where})")
    assert not missing, "the docs name repository paths that do not exist:\n  " + "\n  ".join(missing)


def test_documented_commands_leave_the_clone_clean(workspace):
    # last in this file: after the commands above ran. Whatever a documented command writes
    # by default must land in a git-ignored place, so that `git status` stays empty.
    if not _DONE:
        pytest.skip("no documented command ran in this session")
    for future in list(_DONE.values()):
        future.result()
    assert git_status() == _STATUS_BEFORE[0], "documented commands changed the repository's git status"
    clone = {rel.split("/")[0] for rel in clone_files()} | {".venv"}
    new = sorted(name + ("/" if os.path.isdir(os.path.join(workspace, name)) else "")
                 for name in os.listdir(workspace) if name not in clone)
    shown = [name for name in new if subprocess.run(
        ["git", "-C", REPO, "check-ignore", "-q", "--no-index", "--", name]).returncode != 0]
    assert not shown, ("documented commands wrote these at the top of a clone, where `git status` "
                       "shows them (add them to .gitignore, or write elsewhere): " + ", ".join(shown))
