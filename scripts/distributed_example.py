#!/usr/bin/env python
"""VASSO on several processes: one small model trained under DDP, FSDP2 and
ZeroRedundancyOptimizer, each checkpointed midway and resumed (docs/distributed.md).

    .venv/bin/torchrun --nproc_per_node 2 scripts/distributed_example.py --out runs/distributed

Runs on CPUs (gloo).  Every rank takes its rows of the same global batch; for each setup
rank 0 prints the losses, how far the weights are from one process training on the whole
batch, and how far the run resumed from its checkpoint ends from the uninterrupted one
("identical": bit for bit).  The
checkpoints go under ``--out``: FSDP2's as a torch.distributed.checkpoint folder, DDP's
and ZeRO's as one file written by rank 0.
"""

import argparse
import functools
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from plugins import VASSO

SETUPS = ("ddp", "fsdp2", "zero")
KNOBS = dict(rho=0.1, theta=0.4, p=0.5, seed=4, lr=1e-2)  # eVASSO over AdamW: the coin and d_t both resume


def make_model():
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))  # 5 rows: uneven


def batches(steps, size=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)]


def train(opt, model, data, *, zero=None):
    """One step per batch: each rank its rows, the step the one-process step on all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, two_pass = [], 0
    for x, y in data:
        x, y = x[rank::world], y[rank::world]

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        # ZeRO's second pass needs every parameter at x + eps on every rank: give it the model
        loss = opt.step(closure, model=model) if zero else opt.step(closure)
        losses.append(float(loss.detach()))
        # the diagnostics are the same on every rank (p = 0.5: the coin skips some second
        # passes); reading them also waits for the loss gap's all_reduce
        two_pass += int((opt.optim if zero else opt).diagnostics["two_pass"])
    return losses, two_pass


# ---------------------------------------------------------------- the three setups

def build_ddp():
    model = DDP(make_model())
    return model, VASSO(model.parameters(), torch.optim.AdamW, **KNOBS)


def build_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # parameters are now DTensors, each rank holds its rows
    return model, VASSO(model.parameters(), torch.optim.AdamW, **KNOBS)


def build_zero():
    # ZeRO copies its keywords into its param groups, which a checkpoint saves: bind the
    # class and the process group to the optimizer class instead (a group cannot be saved)
    model = DDP(make_model())
    vasso = functools.partial(VASSO, base_optimizer=torch.optim.AdamW, partition_group=dist.group.WORLD)
    return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=vasso, **KNOBS)


def save(setup, model, opt, path):
    if setup == "fsdp2":  # every rank writes its shards
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        return
    if setup == "zero":
        opt.consolidate_state_dict(to=0)  # every rank takes part
    if dist.get_rank() == 0:
        torch.save({"model": model.module.state_dict(), "optim": opt.state_dict()}, path)
    dist.barrier()


def load(setup, model, opt, path):
    if setup == "fsdp2":  # onto this world size's shards, whatever the saving one was
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        return
    state = torch.load(path, weights_only=True)
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


def full_weights(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def one_process(data):
    """The reference: one process, the whole batch."""
    model = make_model()
    opt = VASSO(model.parameters(), torch.optim.AdamW, **KNOBS)
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        opt.step(closure)
    return [p.detach() for p in model.parameters()]


def run(setup, data, save_at, out):
    build = {"ddp": build_ddp, "fsdp2": build_fsdp2, "zero": build_zero}[setup]
    path = os.path.join(out, setup if setup == "fsdp2" else setup + ".pt")
    model, opt = build()
    zero = setup == "zero"
    losses, two_pass = train(opt, model, data[:save_at], zero=zero)
    save(setup, model, opt, path)
    more, two_pass_after = train(opt, model, data[save_at:], zero=zero)
    losses, two_pass = losses + more, two_pass + two_pass_after
    uninterrupted = full_weights(model)

    model, opt = build()  # a new run, resumed from the checkpoint
    load(setup, model, opt, path)
    train(opt, model, data[save_at:], zero=zero)
    resumed = full_weights(model)
    resume_gap = max(float((a - b).abs().max()) for a, b in zip(resumed, uninterrupted))
    reference = one_process(data)
    error = max(float((a - b).abs().max()) for a, b in zip(uninterrupted, reference))
    return losses, two_pass, error, resume_gap


#: how long a rank other than 0 waits, after a refusal, for torchrun to stop it
REFUSAL_WAIT_S = 60


class _Parser(argparse.ArgumentParser):
    """Under torchrun every rank parses the same command line: rank 0 alone prints a refusal
    (once, before any process group exists) and exits with argparse's status 2.  The other
    ranks wait for torchrun to stop them: it stops every rank as soon as one exits, so one
    that exited at once could stop rank 0 before its message is out."""

    def error(self, message):
        if os.environ.get("RANK", "0") != "0":
            time.sleep(REFUSAL_WAIT_S)
            self.exit(2)
        super().error(message)


def main(argv=None):
    parser = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the checkpoints (must not exist, or be empty)")
    parser.add_argument("--steps", type=int, default=8, help="steps per run (default 8)")
    parser.add_argument("--save-at", type=int, default=4, help="the step after which the checkpoint is taken")
    parser.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS), help="default: all three")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be in [1, inf), got {args.steps}")
    if not 0 < args.save_at < args.steps:
        parser.error(f"--save-at must be in [1, {args.steps - 1}] (within --steps), got {args.save_at}")
    if os.path.exists(args.out) and os.listdir(args.out):
        parser.error(f"--out {args.out} exists and is not empty: name a new folder")
    if "RANK" not in os.environ:
        parser.error("run it under torchrun: .venv/bin/torchrun --nproc_per_node 2 scripts/distributed_example.py "
                     "--out DIR")

    dist.init_process_group("gloo")
    try:
        os.makedirs(args.out, exist_ok=True)
        data = batches(args.steps)
        for setup in args.setups:
            losses, two_pass, error, resume_gap = run(setup, data, args.save_at, args.out)
            resumed = "identical" if resume_gap == 0.0 else f"max |w - uninterrupted| {resume_gap:.1e}"
            if dist.get_rank() == 0:
                print(f"{setup:6s} {dist.get_world_size()} ranks, {args.steps} steps ({two_pass} two-pass): loss "
                      f"{losses[0]:.4f} -> {losses[-1]:.4f} (rank 0's rows), max |w - one process| {error:.1e}, "
                      f"resumed after step {args.save_at}: {resumed}", flush=True)
            # every rank holds the full weights here, so every rank decides alike
            if not (math.isfinite(error) and error < 1e-5 and resume_gap < 1e-5):
                return 1
        # no collective in flight at exit: gloo's barrier waits for this rank's earlier work (the
        # optimizer's loss-gap all_reduce); one completing while the interpreter finalizes aborts
        # the rank ("terminate called without an active exception", docs/distributed.md)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
