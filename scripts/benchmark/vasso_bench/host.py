"""The optimizer's own cost on the host, the CPU proxies of the device benchmark's goal
(``scripts/benchmark/benchmark.py --host-cost``):

* **ops and host syncs per step** of every member on 30 x [Linear(32, 32), LayerNorm(32)]
  (120 tensors): the aten ops dispatched by ``opt.step(closure)`` outside the two passes
  and the base optimizer's step, views and aliases (``OpOverload.is_view``) not counted, and
  the host syncs there (:class:`plugins.lab.selftest.syncs.CountSyncs`, the tests' counter);
* **host time per step** on 50 x [Linear(32, 32), LayerNorm(32)] (200 tensors): the CPU time
  of the calling thread (``time.thread_time``: time slices lost to other processes do not
  count) in the optimizer's own phases (:data:`vasso_bench.phases.OWN`), and with the
  base step, against torch's foreach AdamW step on the same model and gradients; every
  method's base is that foreach AdamW.  Interleaved rounds, medians; one run's ratio.
"""

from __future__ import annotations

import datetime
import platform
import time
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import plugins

from plugins.lab.selftest.reference import MEMBERS
from plugins.lab.selftest.syncs import CountSyncs
from plugins.lab.tables import markdown_table
from plugins.lab.bench.models import BASE_KW, FLOOR_MODEL, RHO, build
from vasso_bench.phases import OWN, PHASES, StepPhases, per_phase, segments
from plugins.lab.bench.timing import median, quartiles

#: 50 x [Linear(32, 32), LayerNorm(32)], no head: 200 small tensors
HOST_MODEL: Dict[str, Any] = dict(FLOOR_MODEL, blocks=50)


#: ops that write their first argument without reading it
_WRITE_ONLY = {"copy_", "_foreach_copy_", "zero_", "_foreach_zero_", "fill_", "_foreach_fill_"}


def _tensors(x) -> List[torch.Tensor]:
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(tensors: List[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CountOps(TorchDispatchMode):
    """Every aten op dispatched inside the mode, views and aliases left out (they launch
    nothing); ``names`` keeps the count per op.  ``bytes``: the memory traffic of those ops,
    each tensor argument read once (but the first of a copy or fill: only written) and each
    tensor the op writes (its mutable arguments, ``out=`` included, else what it returns)
    written once."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.bytes = 0
        self.names: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "aten" and not func.is_view:
            self.count += 1
            key = str(func)
            self.names[key] = self.names.get(key, 0) + 1
            reads, writes = [], []
            for i, arg in enumerate(func._schema.arguments):
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                written = arg.alias_info is not None and arg.alias_info.is_write
                if written:
                    writes += _tensors(value)
                if not (written and (arg.name == "out" or (i == 0 and func.overloadpacket.__name__ in _WRITE_ONLY))):
                    reads += _tensors(value)
            self.bytes += _nbytes(reads) + _nbytes(writes or _tensors(out))
        return out


def _member(name: str, model: torch.nn.Module, foreach: bool = False):
    cls, knobs = MEMBERS[name]
    return getattr(plugins, cls)(model.parameters(), torch.optim.AdamW, rho=RHO, **knobs,
                                 **dict(BASE_KW, foreach=foreach))


def _closure(opt, loss_fn):
    def closure():
        loss = loss_fn()
        loss.backward()
        return loss

    return closure


def ops_and_syncs(members: Sequence[str] = tuple(MEMBERS), model_cfg: Dict[str, Any] = FLOOR_MODEL,
                  warmup: int = 3, tries: int = 8) -> Dict[str, Dict[str, Any]]:
    """Per member: ops and host syncs of a step (after ``warmup``) in its own phases (outside
    the passes and the base step) and in the base step; for eSAM/eVASSO, of the last
    two-pass step and the last one-pass step among ``tries`` (the coin decides; the last, so
    that the one-time set-ups of the first two-pass step on the device path are not counted)."""
    out = {}
    for name in members:
        model, loss_fn = build(model_cfg)
        opt = _member(name, model)
        phases = StepPhases(opt, _closure(opt, loss_fn))
        for _ in range(warmup):
            phases.step()
        model_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
        seen: Dict[int, Dict[str, Any]] = {}
        for _ in range(tries):
            with CountOps() as ops:
                phases.on_mark = lambda: (ops.count, ops.bytes)
                phases.step()
            op_phases, bytes_phases = ({p: 0 for p in PHASES}, {p: 0 for p in PHASES})
            for phase, a, b in segments(phases.marks):
                op_phases[phase] += b[0] - a[0]
                bytes_phases[phase] += b[1] - a[1]
            passes = sum(1 for m, _ in phases.marks if m.startswith("pass"))
            seen[passes] = {"ops": int(sum(op_phases[p] for p in OWN)), "base_ops": int(op_phases["base step"]),
                            "ops_by_phase": {p: int(op_phases[p]) for p in OWN},
                            "traffic": sum(bytes_phases[p] for p in OWN) / model_bytes}
            if getattr(opt, "p", 1.0) >= 1.0:
                break
        with CountSyncs() as syncs:
            phases.on_mark = lambda: syncs.count
            phases.step()
        sync_phases = per_phase(phases.marks)
        main = seen.get(2) or seen[min(seen)]
        out[name] = dict(main, syncs=int(sum(sync_phases[p] for p in OWN)), base_syncs=int(sync_phases["base step"]),
                         passes=2 if 2 in seen else min(seen), one_pass_ops=(seen[1]["ops"] if 1 in seen else None),
                         tensors=len(list(model.parameters())))
    return out


def host_time(methods: Sequence[str] = ("SAM", "VASSO"), model_cfg: Dict[str, Any] = HOST_MODEL,
              rounds: int = 30, steps: int = 5, warmup: int = 3,
              log: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Host CPU ms per step of each method's own phases (and with its base step) and of
    torch's foreach AdamW step alone, on the same model (same initialization and batch),
    in ``rounds`` interleaved rounds of ``steps`` steps; medians and IQRs."""
    clock = time.thread_time
    runs: Dict[str, Any] = {}
    for name in methods:
        model, loss_fn = build(model_cfg)
        opt = _member(name, model, foreach=True)
        runs[name] = StepPhases(opt, _closure(opt, loss_fn), on_mark=clock)
    model, loss_fn = build(model_cfg)
    adamw = torch.optim.AdamW(model.parameters(), **dict(BASE_KW, foreach=True))

    def adamw_step():
        adamw.zero_grad(set_to_none=True)
        loss_fn().backward()
        t0 = clock()
        adamw.step()
        return clock() - t0

    for _ in range(warmup):
        adamw_step()
        for ph in runs.values():
            ph.step()
    samples: Dict[str, List[float]] = {"AdamW": []}
    for name in methods:
        samples[name] = []
        samples[name + "+base"] = []
    order = ["AdamW", *methods]
    for r in range(rounds):
        k = r % len(order)
        for m in order[k:] + order[:k]:
            for _ in range(steps):
                if m == "AdamW":
                    samples[m].append(1e3 * adamw_step())
                    continue
                runs[m].step()
                ph = per_phase(runs[m].marks)
                own = sum(ph[p] for p in OWN)
                samples[m].append(1e3 * own)
                samples[m + "+base"].append(1e3 * (own + ph["base step"]))
        if (r + 1) % 10 == 0:
            log(f"  host time: round {r + 1}/{rounds}")
    out = {"ms": {k: median(v) for k, v in samples.items()}, "iqr": {k: quartiles(v) for k, v in samples.items()},
           "rounds": rounds, "steps": steps, "tensors": len(list(model.parameters()))}
    out["over_adamw"] = {k: out["ms"][k] / out["ms"]["AdamW"] for k in samples if k != "AdamW"}
    return out


def run(log: Callable[[str], None] = lambda s: None, rounds: int = 30) -> Dict[str, Any]:
    log("ops and host syncs per step of every member (120 tensors)")
    ops = ops_and_syncs()
    log(f"host time of the optimizer's own code (200 tensors), {rounds} interleaved rounds")
    host = host_time(rounds=rounds, log=log)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "cpu": cpu,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "ops": ops, "host": host}


def render(res: Dict[str, Any], command: str = "") -> str:
    ops, host = res["ops"], res["host"]
    n_ops = next(iter(ops.values()))["tensors"]
    out = [f"## The optimizer's own cost on the host (CPU proxies), {res['date']}", "",
           f"CPU: {res['cpu']}, torch {res['torch']}, {res['threads']} thread(s).",
           f"Command: `{command}`" if command else "", "",
           f"### Ops and host syncs per step ({n_ops} tensors, closure API, outside the passes)", "",
           "Ops: aten ops dispatched in the optimizer's own phases (step start, perturb, descend), views and "
           "aliases not counted; the base AdamW step's (for-loop, torch's CPU default) apart. Syncs: CountSyncs, "
           "the tests' counter.", "",
           "Traffic: the bytes those ops read and write, in model sizes (the parameters' bytes).", "",
           markdown_table(["member", "ops per two-pass step", "traffic (model sizes)", "perturb / descend / step start",
                           "ops per one-pass step (coin)", "host syncs", "base step ops", "base step syncs"],
                          [[m, r["ops"] if r["passes"] == 2 else "n/a", f"{r['traffic']:.1f}",
                            f"{r['ops_by_phase']['perturb']} / {r['ops_by_phase']['descend']} / "
                            f"{r['ops_by_phase']['step start']}",
                            "" if r["one_pass_ops"] is None else r["one_pass_ops"],
                            r["syncs"], r["base_ops"], r["base_syncs"]] for m, r in ops.items()]), "",
           f"### Host time per step ({host['tensors']} tensors), forward and backward excluded", "",
           f"CPU time of the thread (time.thread_time), median of {host['rounds']} interleaved rounds x "
           f"{host['steps']} steps; every base is torch's foreach AdamW.", ""]
    rows = [["torch AdamW(foreach=True).step()", f"{host['ms']['AdamW']:.3f}",
             "{:.3f}-{:.3f}".format(*host["iqr"]["AdamW"]), "1"]]
    for k, v in host["ms"].items():
        if k == "AdamW":
            continue
        what = (f"{k[:-5]}: its own phases + the base step" if k.endswith("+base")
                else f"{k}: its own phases (step start, perturb, descend)")
        rows.append([what, f"{v:.3f}", "{:.3f}-{:.3f}".format(*host["iqr"][k]), f"{host['over_adamw'][k]:.2f}"])
    out += [markdown_table(["code", "host ms/step", "IQR", "over foreach AdamW"], rows)]
    return "\n".join(out)
