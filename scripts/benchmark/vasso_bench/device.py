"""The device benchmark (``scripts/benchmark/benchmark.py --device cuda``): every member of the family,
AdamW with one and with two passes, and the anchors (the authors' VASSO, davda54's SAM) where
the user points at their checkouts, on ResNet-50 and an IWSLT-sized transformer, with bf16
autocast and AdamW as the base.  It gives the verdicts of the step-cost goal (``GOAL``) where the spread of
the rounds allows one.

* **Time**: every method has its own copy of the model (the same initialization) and shares
  the batch.  After a warm-up, ``rounds`` interleaved rounds (the order rotating every round)
  run ``steps`` steps of each method between two timestamps: CUDA events on a GPU, after a
  ``torch.cuda.synchronize()`` (each method starts on an idle GPU with an empty queue: none
  inherits the queue its predecessor left, which with a rotating order would always be the
  same method), ``time.perf_counter`` on the CPU.
  Per method: the median ms per step and its interquartile range; per method, its ratio to
  "AdamW, two passes" taken within each round, then the median and IQR of those ratios.
* **Memory**: each method alone on the device (model, optimizer, batch; nothing else
  allocated), ``torch.cuda.reset_peak_memory_stats()`` before it is built, the peak after a
  few steps (``max_memory_allocated``).  On the CPU: the peak growth of glibc's heap
  (:class:`vasso_bench.memory.HeapSampler`) from before the build.
* **Verdicts** (:func:`verdict`): a ratio's goal ``<= limit`` is PASS when the 95 % confidence
  interval of the median per-round ratio (:func:`plugins.lab.stats.median_interval`, which
  assumes nothing of the ratios' distribution) lies within it, MISS when it lies beyond it,
  and "too noisy" when it straddles it; no verdict with fewer than :data:`MIN_ROUNDS` rounds.
  The interval narrows as rounds are added, so ``--rounds`` can settle a verdict on a noisy
  host; the IQR, reported beside it, describes the rounds' spread and does not narrow.
"""

from __future__ import annotations

import copy
import datetime
import gc
import math
import platform
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import plugins

from plugins.lab.selftest.reference import MEMBERS
from plugins.lab.stats import median_interval
from plugins.lab.tables import markdown_table
from vasso_bench import anchors
from plugins.lab.bench.models import BASE_KW, RHO, THETA
from plugins.lab.bench.timing import median, quartiles

#: the fewest interleaved rounds a verdict is given on (and the least ``--rounds`` on a GPU)
MIN_ROUNDS = 30
#: the denominator of every ratio: AdamW running the same two forward/backward passes
BASELINE = "adamw-2pass"

#: model sizes: ``full`` is the issue's (for a GPU), ``small`` runs in seconds on a CPU
SIZES: Dict[str, Dict[str, Dict[str, Any]]] = {
    "full": {
        "resnet50": dict(kind="resnet", arch="resnet50", batch=64, image=224, classes=1000, autocast="bf16"),
        "transformer": dict(kind="seq2seq", vocab=10000, d=512, heads=4, ff=1024, layers=6, batch=64, seq=64,
                            dropout=0.1, autocast="bf16"),
    },
    "small": {
        # fp32: on the CPU, bf16 autocast gave a non-finite gradient of layer4's first conv (1x1 feature maps)
        # on some initializations (torch 2.14.1), and the family then skips the step
        "resnet50": dict(kind="resnet", arch="resnet18", batch=2, image=16, classes=10, autocast=None),
        "transformer": dict(kind="seq2seq", vocab=64, d=16, heads=2, ff=32, layers=1, batch=2, seq=6, dropout=0.1,
                            autocast="bf16"),
    },
}
AUTOCAST = {"bf16": torch.bfloat16, None: None}

def _label(member: str, knobs: Dict[str, Any]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in knobs.items() if not isinstance(v, bool))
    name = member.replace("V+G", "VASSO+GSAM")
    return f"{name} ({shown})" if shown else name


#: name -> (label, what builds it, its knobs); the members are the self-test's (one list)
ROWS: Dict[str, tuple] = {
    "adamw-1pass": ("AdamW, one pass", "base", {"passes": 1}),
    BASELINE: ("AdamW, two passes", "base", {"passes": 2}),
    **{name: (_label(name, knobs), cls, dict(knobs)) for name, (cls, knobs) in MEMBERS.items()},
    "ref-vasso": ("official VASSO (BingcongLi/VaSSO)", "--reference-vasso", {"theta": THETA}),
    "ref-sam": ("davda54 SAM", "--reference-sam", {}),
}
#: ``--adamw``: torch's implementation of every row's AdamW (the base of the family and the anchors too);
#: "default" leaves the choice to torch (foreach on a GPU, the for-loop on a CPU)
ADAMW_IMPLS = {"default": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


#: the rows of ``--quick``: those the goal's verdicts need
QUICK_ROWS = ("adamw-1pass", BASELINE, "SAM", "VASSO", "ref-vasso", "ref-sam")

#: the step-cost goal: (method, over what, limit, text); "faster" is a limit of 1 on the ratio
GOAL = [
    ("VASSO", BASELINE, 1.03, "VASSO / AdamW, two passes <= 1.03"),
    ("SAM", BASELINE, 1.02, "SAM / AdamW, two passes <= 1.02"),
    ("VASSO", "ref-vasso", 1.0, "VASSO faster than the official VASSO (ratio < 1)"),
    ("SAM", "ref-sam", 1.0, "SAM faster than davda54's SAM (ratio < 1)"),
]
MEMORY_GOAL = ("VASSO", "ref-vasso", "VASSO's peak memory below the official VASSO's")


# ------------------------------------------------------------------ models

class Seq2Seq(torch.nn.Module):
    """``torch.nn.Transformer`` (post-norm encoder-decoder) with source and target
    embeddings, sinusoidal positions and an output projection: the IWSLT-14 de-en size at
    ``SIZES['full']`` (6+6 layers, 512 wide, 4 heads, FFN 1024, 10k vocabulary: 188 tensors)."""

    def __init__(self, vocab, d, heads, ff, layers, seq, dropout, **_):
        super().__init__()
        self.scale = math.sqrt(d)
        self.src_embed = torch.nn.Embedding(vocab, d)
        self.tgt_embed = torch.nn.Embedding(vocab, d)
        self.transformer = torch.nn.Transformer(d, heads, layers, layers, ff, dropout, batch_first=True)
        self.out = torch.nn.Linear(d, vocab)
        pos = torch.arange(seq).unsqueeze(1) * torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        table = torch.zeros(seq, d)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
        self.register_buffer("pos", table, persistent=False)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, src, tgt):
        n = tgt.shape[1]
        h = self.transformer(self.src_embed(src) * self.scale + self.pos[: src.shape[1]],
                             self.tgt_embed(tgt) * self.scale + self.pos[:n],
                             tgt_mask=self.mask[:n, :n], tgt_is_causal=True)
        return self.out(h)


def build_template(cfg: Dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """The model on the CPU, from ``seed``: every method gets a copy of it."""
    torch.manual_seed(seed)
    if cfg["kind"] == "resnet":
        import torchvision  # a benchmark dependency only

        return getattr(torchvision.models, cfg["arch"])(weights=None, num_classes=cfg["classes"])
    if cfg["kind"] == "seq2seq":
        return Seq2Seq(**cfg)
    raise ValueError(f"unknown model kind {cfg['kind']!r}")


def make_batch(cfg: Dict[str, Any], device: torch.device, seed: int = 1) -> tuple:
    """The fixed batch every method trains on (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    if cfg["kind"] == "resnet":
        x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=g)
        y = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g)
        return x.to(device).contiguous(memory_format=torch.channels_last), y.to(device)
    src = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return src.to(device), tgt.to(device)


def loss_of(cfg: Dict[str, Any], model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    if cfg["kind"] == "resnet":
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)
    src, tgt = batch
    logits = model(src, tgt[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt[:, 1:].reshape(-1))


def describe(cfg: Dict[str, Any], model: torch.nn.Module) -> str:
    ps = list(model.parameters())
    mib = sum(q.numel() * q.element_size() for q in ps) / 2 ** 20
    if cfg["kind"] == "resnet":
        what = f"torchvision {cfg['arch']}, batch {cfg['batch']} at {cfg['image']}, channels_last"
    else:
        what = (f"torch.nn.Transformer {cfg['layers']}+{cfg['layers']} layers, {cfg['d']} wide, FFN {cfg['ff']}, "
                f"{cfg['vocab']} vocabulary, {cfg['batch']}x{cfg['seq']} tokens")
    what += ", bf16 autocast" if cfg.get("autocast") == "bf16" else ", fp32"
    return f"{what}: {len(ps)} tensors, {mib:.1f} MiB" if mib >= 1 else f"{what}: {len(ps)} tensors, {mib:.3f} MiB"


# ------------------------------------------------------------------ one method

class Row:
    """One method on its own copy of the model: ``step()`` is one whole update (bf16
    autocast), as a user's loop would write it; ``passes`` counts forward/backward passes."""

    def __init__(self, name: str, template: torch.nn.Module, cfg: Dict[str, Any], batch: tuple,
                 device: torch.device, anchor_classes: Optional[Dict[str, type]] = None, adamw: str = "default"):
        label, how, knobs = ROWS[name]
        base_kw = dict(BASE_KW, **ADAMW_IMPLS[adamw])
        self.name, self.label, self.cfg, self.batch, self.device = name, label, cfg, batch, device
        self.model = copy.deepcopy(template).to(device)
        if cfg["kind"] == "resnet":
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model.train()
        self.passes = 0
        params = list(self.model.parameters())
        if how == "base":
            self.opt = torch.optim.AdamW(params, **base_kw)
            self.base_passes = knobs["passes"]
            self.step = self._base_step
        elif how in anchors.ANCHORS:
            cls = (anchor_classes or {}).get(how)
            if cls is None:
                raise ValueError(f"row {name!r} needs {how} DIR")
            self.opt = anchors.build(how, cls, params, torch.optim.AdamW, base_kw, RHO, knobs.get("theta", THETA))
            self.step = self._anchor_step
        else:
            self.opt = getattr(plugins, how)(params, torch.optim.AdamW, rho=RHO, **knobs, **base_kw)
            self.step = self._family_step

    def closure(self):
        self.passes += 1
        dtype = AUTOCAST[self.cfg.get("autocast")]
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(self.cfg, self.model, self.batch)
        loss.backward()
        return loss

    def _base_step(self):
        for _ in range(self.base_passes):
            self.opt.zero_grad(set_to_none=True)  # as the family drops g_t before h_t
            self.closure()
        self.opt.step()

    def _family_step(self):
        self.opt.step(self.closure)  # the diagnostics are not read: reading them may sync

    def _anchor_step(self):
        # both anchors' own loops: a first forward/backward, first_step, a second, second_step
        self.opt.zero_grad(set_to_none=True)
        self.closure()
        self.opt.first_step(zero_grad=True)
        self.closure()
        self.opt.second_step(zero_grad=True)


# ------------------------------------------------------------------ clocks

class EventClock:
    """CUDA events on the current stream; read after :meth:`settle` (one synchronize)."""

    def __init__(self, device):
        self.device = device

    def mark(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def settle(self):
        torch.cuda.synchronize(self.device)

    @staticmethod
    def ms(a, b) -> float:
        return a.elapsed_time(b)


class HostClock:
    """``time.perf_counter`` (the CPU: the work is done when the call returns)."""

    def __init__(self, device=None):
        pass

    @staticmethod
    def mark():
        return time.perf_counter()

    def settle(self):
        pass

    @staticmethod
    def ms(a, b) -> float:
        return 1e3 * (b - a)


def clock_for(device: torch.device):
    return EventClock(device) if device.type == "cuda" else HostClock(device)


# ------------------------------------------------------------------ runs

class Interrupted(KeyboardInterrupt):
    """The timed rounds stopped by the user (Ctrl-C, or SIGTERM as ``scripts/benchmark/benchmark.py``
    turns it): :attr:`rounds` holds those finished before it (the one under way is dropped),
    and :func:`run` sets :attr:`result`, the model's report from them."""

    def __init__(self, rounds: Dict[str, Dict[str, List[float]]]):
        super().__init__("interrupted")
        self.rounds = rounds
        self.result: Optional[Dict[str, Any]] = None


def finished(rounds: Dict[str, Dict[str, List[float]]]) -> int:
    """How many rounds :func:`interleaved_rounds` finished (every method has one entry per round)."""
    return len(next(iter(rounds.values()))["ms"]) if rounds else 0


def interleaved_rounds(rows: Dict[str, Row], rounds: int, steps: int, clock,
                       log: Callable[[str], None] = lambda s: None,
                       seconds: Optional[float] = None) -> Dict[str, Dict[str, List[float]]]:
    """Per method, per round: ms per step on the device's clock, host ms per step (the wall
    time the Python thread spent issuing the steps) and host CPU ms per step (the CPU time
    the thread ran for meanwhile: where the two part, the thread waited or was not
    scheduled), passes per step.  The order rotates every round; the clock settles (a
    synchronize on a GPU) before each method's steps, none inside them, and the events are
    read after the round.

    ``rounds`` rounds; with ``seconds``, more while another round (as long as the last) still
    ends within ``seconds`` of the first one's start: the count is set by the clock, never by
    the ratios, whose interval stays honest so (stopping once a verdict appears would not be).
    Interrupted (KeyboardInterrupt), it raises :class:`Interrupted` with the finished rounds."""
    out = {m: {"ms": [], "host_ms": [], "host_cpu_ms": [], "passes": []} for m in rows}
    order = list(rows)
    t0 = began = time.perf_counter()  # began: the last round's start

    def another_fits() -> bool:  # one more round, as long as the last, ends within ``seconds``
        now = time.perf_counter()
        return seconds is not None and (now - t0) + (now - began) <= seconds

    r = 0
    try:
        while r < rounds or another_fits():
            k = r % len(order)
            marks = []
            began = time.perf_counter()
            for m in order[k:] + order[:k]:
                row = rows[m]
                passes = row.passes
                clock.settle()
                h0, c0 = time.perf_counter(), time.thread_time()
                start = clock.mark()
                for _ in range(steps):
                    row.step()
                end = clock.mark()
                marks.append((m, start, end, time.perf_counter() - h0, time.thread_time() - c0, row.passes - passes))
            clock.settle()
            for m, start, end, host, cpu, passes in marks:
                out[m]["ms"].append(clock.ms(start, end) / steps)
                out[m]["host_ms"].append(1e3 * host / steps)
                out[m]["host_cpu_ms"].append(1e3 * cpu / steps)
                out[m]["passes"].append(passes / steps)
            r += 1
            if r % 10 == 0 or r == rounds:
                log(f"  round {r}" + (f"/{rounds}" if seconds is None else f" ({time.perf_counter() - t0:.0f} s)")
                    + ": " + ", ".join(f"{m} {out[m]['ms'][-1]:.1f}" for m in rows) + " ms")
    except KeyboardInterrupt as e:
        raise Interrupted(out) from e
    return out


def peak_memory(name: str, template, cfg, batch, device: torch.device, steps: int,
                anchor_classes: Optional[Dict[str, type]] = None, adamw: str = "default") -> Dict[str, Any]:
    """One method alone on the device: its model, optimizer and steps; the peak bytes
    allocated (GPU: max_memory_allocated after reset_peak_memory_stats, the shared batch
    included) or the peak heap growth (CPU)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        row = Row(name, template, cfg, batch, device, anchor_classes, adamw)
        for _ in range(steps):
            row.step()
        torch.cuda.synchronize(device)
        res = {"peak_bytes": torch.cuda.max_memory_allocated(device), "measure": "max_memory_allocated"}
    else:
        from vasso_bench.memory import HeapSampler

        sampler = HeapSampler()
        before = sampler.current()
        with sampler:
            row = Row(name, template, cfg, batch, device, anchor_classes, adamw)
            for _ in range(steps):
                row.step()
        res = {"peak_bytes": sampler.peak - before if sampler.available else None,
               "measure": "peak heap growth (mallinfo2)"}
    del row
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def summarize(rounds: Dict[str, Dict[str, List[float]]]) -> Dict[str, Any]:
    """Medians and IQRs per method; ratios to AdamW-two-passes and ours over the anchors,
    paired within each round."""
    out: Dict[str, Any] = {"methods": {}, "pairs": {}}
    for m, r in rounds.items():
        out["methods"][m] = {"ms": median(r["ms"]), "ms_iqr": quartiles(r["ms"]), "host_ms": median(r["host_ms"]),
                             "host_cpu_ms": median(r.get("host_cpu_ms", [])),
                             "passes": sum(r["passes"]) / max(len(r["passes"]), 1), "rounds": len(r["ms"])}
    pairs = [(m, BASELINE) for m in rounds if m != BASELINE and BASELINE in rounds]
    pairs += [(ours, ref) for ours, ref, _, _ in GOAL if ref != BASELINE and ours in rounds and ref in rounds]
    for num, den in pairs:
        ratios = paired(rounds[num]["ms"], rounds[den]["ms"])
        out["pairs"][f"{num}/{den}"] = {"median": median(ratios), "iqr": quartiles(ratios), "all": ratios}
    return out


def paired(num: Sequence[float], den: Sequence[float]) -> List[float]:
    """num[i] / den[i]: the two methods' ms per step in the same round."""
    return [a / b for a, b in zip(num, den) if b > 0]


#: the confidence of the interval of the median ratio that the verdicts read
CONFIDENCE = 0.95


def interval(ratios: Sequence[float]) -> Optional[Tuple[float, float]]:
    """The :data:`CONFIDENCE` interval of the median of the finite per-round ratios."""
    return median_interval([x for x in ratios if math.isfinite(x)], CONFIDENCE)


def verdict(ratios: Sequence[float], limit: float, strict: bool = False, min_rounds: int = MIN_ROUNDS) -> str:
    """PASS when the whole confidence interval of the median per-round ratio (:func:`interval`)
    meets the goal (``<= limit``, or ``< limit`` where ``strict``), MISS when none of it
    does, "too noisy" when it straddles the limit; no verdict on fewer than ``min_rounds``
    finite rounds."""
    xs = [x for x in ratios if math.isfinite(x)]
    if len(xs) < min_rounds:
        return f"no verdict: {len(xs)} rounds < {min_rounds}"
    lo, hi = interval(xs)

    def meets(x):
        return x < limit if strict else x <= limit

    return "PASS" if meets(hi) else "MISS" if not meets(lo) else "too noisy"


def goal_rows(results: Dict[str, Any]) -> List[List[str]]:
    """[model, goal, measured, verdict] for the goal's ratios present in the run, and the
    memory lead."""
    rows = []
    for md, res in results["models"].items():
        pairs = res["summary"]["pairs"]
        for ours, ref, limit, text in GOAL:
            p = pairs.get(f"{ours}/{ref}")
            if p is None:
                continue
            ci = interval(p["all"])
            rows.append([md, text, f"{p['median']:.3f} ("
                         + (f"95 % CI {ci[0]:.3f}-{ci[1]:.3f}; " if ci else "")
                         + f"IQR {p['iqr'][0]:.3f}-{p['iqr'][1]:.3f}, {len(p['all'])} rounds)",
                         verdict(p["all"], limit, strict=ref != BASELINE,
                                 min_rounds=results.get("min_rounds", MIN_ROUNDS))])
        mem = res.get("memory", {})
        ours, ref, text = MEMORY_GOAL
        a, b = (mem.get(ours) or {}).get("peak_bytes"), (mem.get(ref) or {}).get("peak_bytes")
        if a is not None and b is not None:
            rows.append([md, text, f"{_size(a)} vs {_size(b)}", "PASS" if a < b else "MISS"])
    return rows


def _ms(x: Optional[float]) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.2f}"  # (n/a: a report without the figure)


def _size(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 2 ** 20:.0f} MiB" if abs(nbytes) >= 10 * 2 ** 20 else f"{nbytes / 2 ** 10:.0f} KiB"


def device_info(device: torch.device) -> Dict[str, Any]:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            info["driver"] = "unknown (no nvidia-smi)"
    return info


def run(device: str = "cpu", size: Optional[str] = None, models: Sequence[str] = ("resnet50", "transformer"),
        rows: Sequence[str] = tuple(ROWS), rounds: int = MIN_ROUNDS, steps: int = 1, warmup: int = 3,
        mem_steps: int = 2, anchor_classes: Optional[Dict[str, type]] = None, memory: bool = True,
        log: Callable[[str], None] = lambda s: None, command: str = "",
        anchor_sources: Optional[Dict[str, str]] = None, adamw: str = "default",
        seconds: Optional[float] = None) -> Dict[str, Any]:
    """The whole benchmark; returns what :func:`render` prints.  Rows whose anchor was not
    given are left out (and listed).  ``seconds``: time each model's rounds for about that
    long, ``rounds`` at least (:func:`interleaved_rounds`).  Interrupted (KeyboardInterrupt),
    it returns what it has: the models finished, the one under way with its finished rounds,
    and ``interrupted`` saying where it stopped."""
    device = torch.device(device)
    size = size or ("full" if device.type == "cuda" else "small")
    anchor_classes = anchor_classes or {}
    kept = [r for r in rows if ROWS[r][1] not in anchors.ANCHORS or ROWS[r][1] in anchor_classes]
    t0 = time.time()
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN picks its kernels during the warm-up
    results: Dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "command": command,
        "machine": device_info(device), "size": size, "rounds": rounds, "steps": steps, "warmup": warmup,
        "seconds_per_model": seconds, "mem_steps": mem_steps, "min_rounds": MIN_ROUNDS, "rows": kept,
        "left_out": [r for r in rows if r not in kept], "models": {},
        "anchors": dict(anchor_sources or {}), "adamw": adamw}
    for md in models:
        try:
            results["models"][md] = _one_model(md, SIZES[size][md], kept, device, rounds, steps, warmup, mem_steps,
                                               anchor_classes, memory, adamw, seconds, log)
        except Interrupted as stop:
            n = finished(stop.rounds)
            if n:
                results["models"][md] = stop.result
            results["interrupted"] = f"during {md}'s timed rounds, after {n} finished round(s)" + (
                ", kept below" if n else "")
            break
        except KeyboardInterrupt:
            results["interrupted"] = f"during {md}, outside its timed rounds: nothing of {md} kept"
            break
    if "interrupted" in results:
        log(f"interrupted {results['interrupted']}")
    results["seconds"] = round(time.time() - t0, 1)
    return results


def _one_model(md: str, cfg: Dict[str, Any], kept: List[str], device: torch.device, rounds: int, steps: int,
               warmup: int, mem_steps: int, anchor_classes: Dict[str, type], memory: bool, adamw: str,
               seconds: Optional[float], log: Callable[[str], None]) -> Dict[str, Any]:
    """One model's part of :func:`run`: memory, warm-up, timed rounds, summary."""
    template = build_template(cfg)
    batch = make_batch(cfg, device)
    res: Dict[str, Any] = {"info": describe(cfg, template), "memory": {}}
    log(f"{md} ({res['info']})")
    if memory:
        peak_memory(kept[0], template, cfg, batch, device, 1, anchor_classes, adamw)  # untimed: one-time allocs
        for name in kept:
            res["memory"][name] = peak_memory(name, template, cfg, batch, device, mem_steps, anchor_classes, adamw)
        log("  peak memory, each method alone: " + ", ".join(
            f"{n} {_size(v['peak_bytes'])}" for n, v in res["memory"].items()))
    built = {name: Row(name, template, cfg, batch, device, anchor_classes, adamw) for name in kept}
    clock = clock_for(device)
    t_warm = time.time()
    for row in built.values():
        for _ in range(warmup):
            row.step()
    clock.settle()
    per_step = (time.time() - t_warm) / max(warmup * len(built), 1)
    log(f"  {rounds} interleaved rounds x {steps} step(s) of {len(built)} methods"
        + (f" (about {per_step * rounds * steps * len(built):.0f} s at the warm-up's pace)" if warmup else "")
        + (f", then more for up to {seconds:g} s in all" if seconds is not None else ""))
    try:
        res["rounds"] = interleaved_rounds(built, rounds, steps, clock, log=log, seconds=seconds)
    except Interrupted as stop:
        res["rounds"], res["summary"] = stop.rounds, summarize(stop.rounds)
        stop.result = res
        raise
    res["summary"] = summarize(res["rounds"])
    # read once, after the timing (it may sync): a skipped step costs less than a taken one
    res["nonfinite_steps"] = {name: int(row.opt.nonfinite_steps) for name, row in built.items()
                              if getattr(row.opt, "nonfinite_steps", 0)}
    del built, template, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def _rounds(results: Dict[str, Any]) -> str:
    """How many rounds were asked for: a number, or at least one and a time."""
    if results.get("seconds_per_model") is None:
        return str(results["rounds"])
    return f"at least {results['rounds']} (more while {results['seconds_per_model']:g} s per model lasted)"


def render(results: Dict[str, Any]) -> str:
    m = results["machine"]
    dev = (f"{m['gpu']} (compute capability {m['capability']}, {m['memory_gib']} GiB), driver {m['driver']}, "
           f"CUDA {m['cuda']}, cuDNN {m['cudnn']}" if "gpu" in m else f"CPU ({m['cpu']})")
    out = [f"## Device benchmark: {results['machine']['device']}, {results['size']} sizes, {results['date']}", "",
           f"Device: {dev}; torch {m['torch']}, Python {m['python']}.",
           f"Command: `{results['command']}`" if results.get("command") else "",
           f"AdamW base ({results.get('adamw', 'default')} implementation, lr {BASE_KW['lr']}, "
           f"weight decay {BASE_KW['weight_decay']}), rho {RHO}; "
           f"{results['warmup']} warm-up steps per method, then {_rounds(results)} interleaved rounds (the order "
           f"rotating) of {results['steps']} step(s) per method, timed with "
           + ("CUDA events (a synchronize before each method's steps, none inside them)" if "gpu" in m
              else "time.perf_counter")
           + "; ratios paired within a round.", ""]
    for flag, source in results.get("anchors", {}).items():
        out.append(f"Anchor {flag}: {source}.")
    if results.get("anchors"):
        out.append("")
    if results.get("interrupted"):
        out += [f"**Interrupted** {results['interrupted']}: what follows is what had finished.", ""]
    if results.get("left_out"):
        out += [f"Left out (no checkout given): {', '.join(ROWS[r][0] for r in results['left_out'])}.", ""]
    for md, why in results.get("models_left_out", {}).items():
        out += [f"Left out: the model {md}, which {why}.", ""]
    out += ["### Verdicts (the step-cost goal)", "",
            f"PASS: the 95 % confidence interval (CI) of the median per-round ratio meets the goal; MISS: none of "
            f"it does; too noisy: it straddles the goal (more rounds, `--rounds` or `--seconds`, narrow it); "
            f"no verdict under {results.get('min_rounds', MIN_ROUNDS)} rounds. The IQR is the rounds' spread.", "",
            markdown_table(["model", "goal", "measured", "verdict"], goal_rows(results)), ""]
    for md, res in results["models"].items():
        s = res["summary"]
        base_ms = s["methods"].get(BASELINE, {}).get("ms")
        out += [f"### {md}: {res['info']}", "", f"{finished(res['rounds'])} interleaved rounds.", ""]
        table = []
        for name, row in s["methods"].items():
            p = s["pairs"].get(f"{name}/{BASELINE}")
            mem = res["memory"].get(name, {}).get("peak_bytes")
            base_mem = res["memory"].get(BASELINE, {}).get("peak_bytes")
            table.append([ROWS[name][0], f"{row['ms']:.2f}", f"{row['ms_iqr'][0]:.2f}-{row['ms_iqr'][1]:.2f}",
                          "1" if name == BASELINE else (f"{p['median']:.3f}" if p else "n/a"),
                          f"{p['iqr'][0]:.3f}-{p['iqr'][1]:.3f}" if p else "",
                          f"{row['host_ms']:.2f}", _ms(row.get("host_cpu_ms")), f"{row['passes']:.2f}",
                          _size(mem),
                          "" if mem is None or not base_mem else f"{mem / base_mem:.3f}"])
        out += [markdown_table(["method", "ms/step (median)", "IQR", "over AdamW, two passes", "IQR",
                                "host ms/step", "host CPU ms/step", "passes/step", "peak memory (alone)",
                                "peak over AdamW, two passes"], table), ""]
        for key, p in s["pairs"].items():
            ours, ref = key.split("/")
            if ref != BASELINE:
                out.append(f"- {ROWS[ours][0]} / {ROWS[ref][0]} = {p['median']:.3f} "
                           f"(IQR {p['iqr'][0]:.3f}-{p['iqr'][1]:.3f})")
        if base_ms:
            out.append(f"- AdamW, two passes: {base_ms:.2f} ms/step (the denominator)")
        for name, n in res.get("nonfinite_steps", {}).items():
            out.append(f"- **{ROWS[name][0]} skipped {n} step(s) for a non-finite gradient** (warm-up and rounds): "
                       "a skipped step costs less, so its times understate a taken one's")
        mem_kind = next((v["measure"] for v in res["memory"].values()), None)
        if mem_kind:
            out.append(f"- memory: {mem_kind}, each method alone, after {results.get('mem_steps', 2)} steps")
        out.append("")
    out.append(f"Wall time: {results.get('seconds')} s.")
    return "\n".join(out)
