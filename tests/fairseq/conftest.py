"""Shared fixtures for the fairseq plugin tests: a generated toy de->en corpus,
binarized once per session with fairseq-preprocess, and helpers that run real
fairseq-train (in-process, or as subprocesses for the distributed test).

Skipped as a whole when fairseq is not importable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
from pathlib import Path

import cpu_only
import process_group
import pytest

REPO = Path(__file__).resolve().parents[2]

# Each test module skips itself (pytest.importorskip) when fairseq is missing; this
# file imports nothing from fairseq at module level so that collection stays clean.
SKIP_REASON = "fairseq is not installed (pip install --no-build-isolation fairseq-fixed==0.12.3.1)"


def user_dir():
    """The folder to pass to --user-dir: where fairseq_vasso is imported from."""
    import fairseq_vasso

    return os.path.dirname(fairseq_vasso.__file__)

# ------------------------------------------------------------------ toy corpus

_DE_EN = {
    # articles / function words
    "der": "the", "die": "the", "das": "the", "ein": "a", "eine": "a", "und": "and", "nicht": "not",
    "mit": "with", "im": "in the", "auf": "on",
    # nouns
    "hund": "dog", "katze": "cat", "haus": "house", "baum": "tree", "mann": "man", "frau": "woman",
    "kind": "child", "buch": "book", "auto": "car", "stadt": "city", "garten": "garden", "tisch": "table",
    "vogel": "bird", "apfel": "apple", "lehrer": "teacher", "freund": "friend",
    # verbs
    "sieht": "sees", "hat": "has", "liest": "reads", "mag": "likes", "findet": "finds", "kauft": "buys",
    "malt": "paints", "sucht": "seeks",
    # adjectives
    "rote": "red", "kleine": "small", "alte": "old", "neue": "new", "gute": "good", "grosse": "big",
}
_ARTS = ["der", "die", "das", "ein", "eine"]
_NOUNS = ["hund", "katze", "haus", "baum", "mann", "frau", "kind", "buch", "auto", "stadt", "garten",
          "tisch", "vogel", "apfel", "lehrer", "freund"]
_VERBS = ["sieht", "hat", "liest", "mag", "findet", "kauft", "malt", "sucht"]
_ADJS = ["rote", "kleine", "alte", "neue", "gute", "grosse"]
_PLACES = ["mit", "im", "auf"]


def _noun_phrase(rng):
    words = [rng.choice(_ARTS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJS))
    words.append(rng.choice(_NOUNS))
    return words


def _sentence(rng):
    de = _noun_phrase(rng) + [rng.choice(_VERBS)]
    if rng.random() < 0.3:
        de.append("nicht")
    de += _noun_phrase(rng)
    if rng.random() < 0.4:
        de += [rng.choice(_PLACES)] + _noun_phrase(rng)[1:]
    if rng.random() < 0.2:
        de += ["und"] + _noun_phrase(rng) + [rng.choice(_VERBS)] + _noun_phrase(rng)
    # English: word by word, with "not" after the verb becoming "does not" + base form is
    # too much grammar for a toy; keep the order, translate each word.
    en = " ".join(_DE_EN[w] for w in de)
    return " ".join(de), en


def write_toy_corpus(root: Path, n_train=400, n_valid=40, n_test=40, seed=0):
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", n_train), ("valid", n_valid), ("test", n_test)):
        pairs = [_sentence(rng) for _ in range(n)]
        (root / f"{split}.de").write_text("".join(de + "\n" for de, _ in pairs))
        (root / f"{split}.en").write_text("".join(en + "\n" for _, en in pairs))
    return root


def binarize(raw: Path, dest: Path):
    from fairseq import options
    from fairseq_cli import preprocess

    parser = options.get_preprocessing_parser()
    args = parser.parse_args([
        "--source-lang", "de", "--target-lang", "en",
        "--trainpref", str(raw / "train"), "--validpref", str(raw / "valid"), "--testpref", str(raw / "test"),
        "--destdir", str(dest), "--workers", "1", "--joined-dictionary",
    ])
    preprocess.main(args)
    return dest


@pytest.fixture(scope="session")
def toy_data(tmp_path_factory):
    """Binarized toy de->en corpus (400/40/40 sentence pairs)."""
    base = tmp_path_factory.mktemp("toy")
    raw = write_toy_corpus(base / "raw")
    return binarize(raw, base / "bin")


# ------------------------------------------------------------------ training

def model_args(data, save_dir, *, optimizer="vasso", max_update=8, extra=()):
    """fairseq-train arguments of the stock AdamW recipe on a tiny transformer."""
    from fairseq_vasso.nmt.recipe import toy_train_args

    args = toy_train_args(data, save_dir, optimizer_flags=["--optimizer", optimizer], lr=2e-3, max_update=max_update)
    # one process unless extra says otherwise: fairseq's default is the number of GPUs it saw when imported
    return args + ["--cpu", "--distributed-world-size", "1", "--no-epoch-checkpoints", *extra]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append((record.name, record.getMessage()))


class TrainResult:
    def __init__(self, records, save_dir):
        self.records = records
        self.save_dir = Path(save_dir)

    def stats(self, tag):
        """The JSON stats lines fairseq logged under ``tag`` (train_inner, train, valid)."""
        out = []
        for name, msg in self.records:
            if name == tag and msg.startswith("{"):
                out.append(json.loads(msg))
        return out

    def inner(self):
        return self.stats("train_inner")

    def losses(self):
        return [float(s["loss"]) for s in self.inner()]

    def text(self):
        return "\n".join(f"{n} | {m}" for n, m in self.records)


def train(argv):
    """Run fairseq-train in this process (as fairseq_cli.train.cli_main does); with ``--cpu``,
    as on a CPU-only host wherever the test runs (cpu_only.in_process: fairseq's --cpu would
    otherwise take its gradient norm through a GPU it sees)."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils
    from fairseq_cli import train as train_cli

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=list(argv))
    cfg = convert_namespace_to_omegaconf(args)
    cap = _Capture()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(cap)
    root.setLevel(logging.INFO)
    try:
        with cpu_only.in_process() if "--cpu" in argv else contextlib.nullcontext():
            distributed_utils.call_main(cfg, train_cli.main)
    finally:
        root.removeHandler(cap)
        root.setLevel(old_level)
    save_dir = argv[argv.index("--save-dir") + 1] if "--save-dir" in argv else "checkpoints"
    return TrainResult(cap.records, save_dir)


def load_checkpoint(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def run_cli(module, argv, *, env=None, timeout=300):
    """Run ``python -m module argv`` in the test's temporary folder (its working directory),
    with no GPU visible where argv has ``--cpu`` (cpu_only.env); returns CompletedProcess."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    full_env.setdefault("OMP_NUM_THREADS", "1")
    if env:
        full_env.update(env)
    if "--cpu" in argv:
        full_env = cpu_only.env(full_env)
    return process_group.run([sys.executable, "-m", module, *argv], env=full_env,
                             capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ fp16 / AMP on a CPU

def cpu_half_precision_patches():
    """fairseq's real ``--fp16`` / ``--memory-efficient-fp16`` / ``--amp`` code on a CPU:
    ``(owner, attribute, value)`` for the four device checks to patch.

    fairseq 0.12 runs these modes through its own Trainer, FP16Optimizer,
    MemoryEfficientFP16Optimizer, DynamicLossScaler and AMPOptimizer; all of them run
    unchanged.  Patched, and nothing else:

    1. ``torch.cuda.current_device()`` returns None: FP16Optimizer keys the flat fp32
       master copy by it and finds the fp16 params by ``p.device.index``, which is
       None for a CPU tensor.
    2. ``torch.Tensor.cuda`` is the identity: the Trainer's overflow handler sets
       ``grad_norm = torch.tensor(0.0).cuda()``.
    3. ``torch.cuda.amp.GradScaler`` builds ``torch.amp.GradScaler("cpu", ...)``, a
       real scaler (scales, unscales, finds inf, backs off, grows): AMPOptimizer
       builds its scaler with the CUDA class, which disables itself without a GPU.
    4. ``torch.cuda.amp.autocast`` is ``torch.autocast("cpu", dtype=torch.float16)``
       (FairseqTask.train_step's autocast): real fp16 arithmetic, real overflow.
    """
    import torch

    return [
        (torch.cuda, "current_device", lambda: None),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.cuda.amp, "GradScaler", lambda **kw: torch.amp.GradScaler("cpu", **kw)),
        (torch.cuda.amp, "autocast",
         lambda enabled=True, **kw: torch.autocast("cpu", dtype=torch.float16, enabled=enabled)),
    ]


@pytest.fixture
def cpu_half_precision(monkeypatch):
    """:func:`cpu_half_precision_patches` for one test."""
    for owner, name, value in cpu_half_precision_patches():
        monkeypatch.setattr(owner, name, value)


def overflow_scales(result):
    """The loss scales fairseq announced on each overflow, in order (its own log lines:
    ``--fp16``: the Trainer's OverflowError note; ``--amp``: AMPOptimizer's)."""
    out = []
    for name, msg in result.records:
        if name == "fairseq.trainer" and "gradient overflow detected" in msg:
            out.append(float(msg.rsplit(":", 1)[1]))
        elif name == "fairseq.optim.amp_optimizer" and "AMP: overflow detected" in msg:
            out.append(float(msg.rsplit(" ", 1)[1]))
    return out


@pytest.fixture
def fs():
    """Helpers as a namespace (test modules cannot import conftest under importlib mode)."""

    class NS:
        pass

    ns = NS()
    ns.model_args = model_args
    ns.train = train
    ns.load_checkpoint = load_checkpoint
    ns.run_cli = run_cli
    ns.USER_DIR = user_dir()
    ns.REPO = REPO
    ns.overflow_scales = overflow_scales
    return ns
