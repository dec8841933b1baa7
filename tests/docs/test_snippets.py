"""Every loop the docs show is a correct loop.

Each Python snippet of README.md and docs/*.md that trains (it calls ``backward()`` or
``step(``) runs here, as the docs hold it, over several batches: a snippet that is one
step runs once per batch (as it runs when pasted into a loop), a snippet with its own
loop runs once. Its model must then end where a reference loop ends: the core's host
protocol written out once below (clear, first backward, ``perturb``, the second pass
inside ``second_pass``, ``descend``), on the same model, data and RNG stream. A snippet
that leaves ``h_t`` in ``.grad`` before the next step's first backward, runs a pass too
many, or mixes up its optimizers ends elsewhere. (tests/docs/test_docs_commands.py runs
every snippet once with the reader's objects filled in; this file checks the loops.)

A snippet is found by its first line of code; when the docs change one, the failure
names it.
"""

import contextlib
import glob
import os
import re

import pytest
import torch
import torch.nn.functional as F

import plugins
from plugins import SAM, VASSO, rng_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC_FILES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))
STEPS = 5


def _head(code):
    """The first line of code (comments and blanks dropped, spaces collapsed)."""
    for line in code.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            return re.sub(r"\s+", " ", line)
    return ""


def doc_snippets():
    """(file, line, head, code) of every ```python block."""
    out = []
    for rel in DOC_FILES:
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:
            text = f.read()
        for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text.count("\n", 0, m.start()) + 2
            out.append((rel, line, _head(m.group(1)), m.group(1)))
    return out


SNIPPETS = doc_snippets()


def _trains(code):
    return ".backward()" in code or ".step(" in code


# ------------------------------------------------------------------ the reader's objects


def make_model(dropout=0.1):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Dropout(dropout), torch.nn.Linear(8, 3))


def make_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]


def smooth_crossentropy(pred, gold, smoothing=0.1):
    """davda54/sam's example/model/smooth_cross_entropy.py (the loss the classic loop uses)."""
    one_hot = torch.full_like(pred, fill_value=smoothing / (pred.size(1) - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    return F.kl_div(input=F.log_softmax(pred, dim=1), target=one_hot, reduction="none").sum(-1)


def disable_running_stats(model):
    """davda54/sam's example/utility/bypass_bn.py: BatchNorm's momentum 0 for the second pass."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            m.backup_momentum, m.momentum = m.momentum, 0


def enable_running_stats(model):
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and hasattr(m, "backup_momentum"):
            m.momentum = m.backup_momentum


def readers_namespace():
    model = make_model()
    batches = make_batches()
    cross_entropy = torch.nn.CrossEntropyLoss()
    # the names the docs import earlier on the page (rng_state: README's "plugins.rng_state"; SAM:
    # migration.md's table, above its GSAM port)
    return {"torch": torch, "plugins": plugins, "rng_state": rng_state, "SAM": SAM, "model": model, "batches": batches, "loss_fn": cross_entropy,
            "criterion": cross_entropy, "smooth_crossentropy": smooth_crossentropy,
            "enable_running_stats": enable_running_stats, "disable_running_stats": disable_running_stats,
            "loss": lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
            "x": batches[0][0], "y": batches[0][1]}


# ------------------------------------------------------------------ the reference loop


def reference(model, opt, batches, loss_of, *, replay=True, freeze_bn=True, scaler=None, clip=None,
              scheduler=None, autocast=None):
    """The host protocol of docs/torch.md ("Two ways to take a step"), step by step."""
    cast = (lambda: torch.autocast(autocast, dtype=torch.float16)) if autocast else contextlib.nullcontext
    scale = scaler.scale if scaler is not None else (lambda loss: loss)
    for batch in batches:
        rng = rng_state() if replay else None
        opt.zero_grad()
        with cast():
            first = loss_of(model, batch)
        scale(first).backward()
        second = None
        if opt.perturb(scaler=scaler, loss=first):
            opt.zero_grad()
            with opt.second_pass(model if freeze_bn else None, rng):
                with cast():
                    second = loss_of(model, batch)
                scale(second).backward()
        if scaler is not None:
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt, loss=second)
            scaler.update()
        else:
            opt.descend(loss=second)
        if scheduler is not None:
            scheduler.step()


def _setup_and_loop(code):
    """The snippet's lines before its first top-level ``for`` or ``def`` (what builds the
    optimizer, or the whole self-contained setup), and the rest."""
    lines = code.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("for ", "def ")):
            return "".join(lines[:i]), "".join(lines[i:])
    return code, ""


# ------------------------------------------------------------------ the cases


def _vasso(model):
    return VASSO(model.parameters(), torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-3)


def _sam(model):
    return SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)


def ce(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1])


# head -> (kind, the reader's optimizer (its name, builder) or None when the snippet builds its
# own, the loss of a batch, the reference's options)
#   body:  one step, run once per batch;  loop: its own loop over `batches`;
#   closure-step: builds the optimizer and takes one closure step (README's first);
#   standalone: builds everything itself (setup before its loop)
CASES = {
    "import torch": ("closure-step", None, ce, {"freeze_bn": False}),
    "rng = rng_state()": ("body", ("opt", _vasso), ce, {}),
    "from plugins import rng_state": ("body", ("optimizer", _sam), ce, {}),
    "from plugins import SAM": (
        "loop", None, lambda m, b: smooth_crossentropy(m(b[0]), b[1]).mean(), {"replay": False}),
    "optimizer = SAM(model.parameters(), torch.optim.SGD, rho=2.0, rho_min=0.2, gsam_alpha=0.4,": (
        "loop", None, ce, {}),
    "from plugins import VASSO": ("loop", None, ce, {"replay": False, "freeze_bn": False}),
    'device = "cpu"': ("standalone", None, None, {}),
}
NOT_RUN = {
    "from composer import Trainer": "Composer is not a dependency of this project (no loop of ours in it)",
}


def test_every_loop_of_the_docs_is_run_here():
    assert len(SNIPPETS) >= 8
    missing = [f"{f}:{line}: {head}" for f, line, head, code in SNIPPETS
               if _trains(code) and head not in CASES and head not in NOT_RUN]
    assert not missing, ("snippets that train, unknown to tests/docs/test_snippets.py (add each to CASES):\n  "
                         + "\n  ".join(missing))
    stale = [h for h in list(CASES) + list(NOT_RUN) if not any(head == h for _, _, head, _ in SNIPPETS)]
    assert not stale, f"CASES names snippets no doc holds any more: {stale}"


def _state(model):
    """Parameters and BatchNorm's running statistics (its step counter aside: davda54's
    helpers count the second pass, ours does not)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def _assert_same(ran, expected, where):
    assert ran.keys() == expected.keys()
    for key in ran:
        assert torch.allclose(ran[key], expected[key], rtol=0, atol=1e-6), (
            f"{where}: after the loop, {key} differs from the reference loop's by "
            f"{(ran[key] - expected[key]).abs().max().item():.3g}")


@pytest.mark.parametrize("snippet", [pytest.param(s, id=f"{s[0]}:{s[1]}") for s in SNIPPETS if s[2] in CASES])
def test_the_loop_ends_where_the_reference_ends(snippet):
    rel, line, head, code = snippet
    kind, reader_opt, loss_of, options = CASES[head]
    where = f"{rel}:{line} ({head})"
    if kind == "standalone":  # its setup seeds the RNG: the reference's restarts it the same way
        setup, _ = _setup_and_loop(code)
        ran, ref = {}, {}
        exec(compile(code, where, "exec"), ran)
        exec(compile(setup, where, "exec"), ref)
        device = ref["device"]
        reference(ref["model"], ref["opt"], ref["loader"], lambda m, b: ref["loss_fn"](m(b[0]), b[1]),
                  scaler=torch.amp.GradScaler(device), clip=ref["max_norm"], autocast=device)
        assert ran["opt"].num_steps == ref["opt"].num_steps == len(ran["loader"]) and not ran["opt"].in_flight
        _assert_same(_state(ran["model"]), _state(ref["model"]), where)
        # both APIs record the loss gap here (the closure returns its loss; the explicit loop hands both over)
        assert ran["opt"].diagnostics["loss_gap"] == pytest.approx(ref["opt"].diagnostics["loss_gap"], abs=1e-6)
        return

    ran, ref = readers_namespace(), readers_namespace()
    batches = ran["batches"]
    if kind == "body":
        name, build = reader_opt
        ran[name], ref[name] = build(ran["model"]), build(ref["model"])
        torch.manual_seed(2)
        for x, y in batches:
            ran.update(batch=(x, y), x=x, y=y, inputs=x, targets=y, images=x)
            exec(compile(code, where, "exec"), ran)
        opt = ref[name]
    elif kind == "closure-step":
        batches = batches[:1]  # one step, as the README shows it
        torch.manual_seed(2)
        exec(compile(code, where, "exec"), ran)
        setup, _ = _setup_and_loop(code)
        exec(compile(setup, where, "exec"), ref)
        opt = ref["opt"]
    else:  # loop
        setup, _ = _setup_and_loop(code)
        torch.manual_seed(2)
        exec(compile(code, where, "exec"), ran)
        exec(compile(setup, where, "exec"), ref)
        opt = ref["optimizer"]
    name = "optimizer" if "optimizer" in ran else "opt"
    assert ran[name] is not opt and not ran[name].in_flight
    assert ran[name].num_steps == len(batches), f"{where}: {ran[name].num_steps} steps over {len(batches)} batches"
    torch.manual_seed(2)
    reference(ref["model"], opt, batches, loss_of, scheduler=ref.get("scheduler"), **options)
    _assert_same(_state(ran["model"]), _state(ref["model"]), where)
