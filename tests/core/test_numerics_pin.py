"""SAM's and VASSO's single-process trajectories, pinned bit for bit: a change of rounding
is a decision, announced in its commit, not an accident.

Commit 4a542cc moved the norms to local sums of squares combined once in float64, with the
square root after. That changed the demo's weights by one float32 rounding after one
update, and its BLEU table by up to 0.4 after 320 (issue 34), and no test noticed: the
bit-for-bit pins of tests/core/test_state_dict.py use a model of 4 small tensors whose norm
reduces in one part, where the old float32 combination and the float64 one give the same
number. This model's norms reduce in 12 parts, over 26 tensors of 1 to 65,536 elements
(the demo's transformer's in 11 or more), and the test first checks that the two
combinations differ on its gradients, so that the pins below see such a change.

If this test fails after a change of the core, the change moved the numerics. If that is
intended: say so in the commit message, re-measure what the docs report from them (the
demo's table in docs/reports/demo.md and the README's results, which a CI check compares
with a demo run, tests/scripts/test_demo_readme.py), and write the new values below (print
them with ``python tests/core/test_numerics_pin.py``).

The exact values depend on the torch build and on the CPU kernels torch picks (its CPU
capability: AVX512, AVX2, ...), one thread here: they are pinned for the torch that
scripts/setup_env.sh installs (and CI uses) on the CPU kind they were computed on; with
another torch (CI's compat stage runs tests/core under torch 2.1.2, the floor) or CPU kind,
the test skips, saying so. The core keeps the float64 combination, the more accurate one
(docs/design.md).
"""

import hashlib
import sys

import pytest
import torch

from plugins import SAM, VASSO

# torch.__version__ without a local part ("+cu130", "+cpu": the same CPU kernels)
PINNED_TORCH = "2.14.1"
# {CPU capability: {case: (sha256 of the weights after STEPS steps, float.hex of each step's loss)}}
# computed 2026-11-27 at commit e7c2098 (the core of d4fcd2c), torch 2.14.1+cu130, AMD EPYC (AVX512)
PINS = {
    "AVX512": {
        # the steps decided on the device (plugins.ondevice), computed 2026-11-27: one flat float32
        # norm and dot instead of the float64 combination of per-part norms
        "SAM-AdamW": ("b5406779f7f3aa264f79a248cb382d594ed838e4f3c2c4728282691627cdf0c5",
                      ["0x1.2b8af00000000p+1", "0x1.f0e0120000000p+1", "0x1.2943920000000p+2", "0x1.3143a40000000p+2",
                       "0x1.1e43020000000p+2", "0x1.b90d3a0000000p+1", "0x1.4a5fe60000000p+1", "0x1.eeb9ba0000000p+0"]),
        "VASSO-AdamW": ("308e895a32117ed56f499f15580fafb5096c9208c53fd915218b217a6af89dda",
                        ["0x1.2b8af00000000p+1", "0x1.f0e0120000000p+1", "0x1.0dc98a0000000p+2", "0x1.f4262e0000000p+1",
                         "0x1.f537f00000000p+1", "0x1.828ef40000000p+1", "0x1.7345b80000000p+1", "0x1.b4cec80000000p+1"]),
        "SAM-AdamW host path": ("595772621c5c9c257e123d7093fb75e40546a6fb6e15fb218dabe6e35ee44805",
                      ["0x1.2b8af00000000p+1", "0x1.f0e0120000000p+1", "0x1.29442a0000000p+2", "0x1.3143ca0000000p+2",
                       "0x1.1d71e80000000p+2", "0x1.7b79200000000p+1", "0x1.2a008c0000000p+1", "0x1.4eaa720000000p+1"]),
        "VASSO-AdamW host path": ("79c0304039a7e3dc811689b85435acd1fc96f3dce818612a6211e405be9c7164",
                        ["0x1.2b8af00000000p+1", "0x1.f0e0120000000p+1", "0x1.0dc9740000000p+2",
                         "0x1.f427a00000000p+1", "0x1.f5384c0000000p+1", "0x1.828f380000000p+1",
                         "0x1.17a8840000000p+2", "0x1.b36ff40000000p+1"]),
    },
}
STEPS = 8


def capability():
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get() if get else "unknown"


# the widths of ManyParts' hidden layers: each weight has 32,768 to 65,536 elements, so that
# the core's norms reduce it alone (plugins.reductions.chunk_plan)
WIDTHS = [128, 256, 192, 256, 160, 256, 224, 256, 192, 256, 256]


class ManyParts(torch.nn.Module):
    """Token ids -> mean-pooled embedding -> 10 tanh layers of varied widths -> LayerNorm -> 7
    classes, and a learned output temperature: 26 parameter tensors of 1 to 65,536 elements,
    whose norms the core reduces in 12 parts (11 large tensors alone, the small ones together),
    as the demo's transformer's in 11 or more."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(300, WIDTHS[0])
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        self.norm = torch.nn.LayerNorm(WIDTHS[-1])
        self.out = torch.nn.Linear(WIDTHS[-1], 7)
        self.temperature = torch.nn.Parameter(torch.ones(()))

    def forward(self, ids):
        h = self.embed(ids).mean(1)
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        return self.out(self.norm(h)) * self.temperature


def _host_path(opt):
    opt._decide_on_device = False  # every step reads its scalars on the host (docs/design.md, "Where a step is decided")
    return opt


# The steps decided on the device (plugins.ondevice, the default here) and the host path; the
# host path's pins are those of the core before the device path was added (e7c2098): that
# path is unchanged, bit for bit.
CASES = {
    "SAM-AdamW": lambda ps: SAM(ps, torch.optim.AdamW, rho=0.1, lr=1e-2, weight_decay=1e-4, betas=(0.9, 0.98)),
    "VASSO-AdamW": lambda ps: VASSO(ps, torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-2, weight_decay=1e-4,
                                    betas=(0.9, 0.98)),
    "SAM-AdamW host path": lambda ps: _host_path(CASES["SAM-AdamW"](ps)),
    "VASSO-AdamW host path": lambda ps: _host_path(CASES["VASSO-AdamW"](ps)),
}


def batches(n=STEPS):
    g = torch.Generator().manual_seed(34)
    return [(torch.randint(0, 300, (16, 5), generator=g), torch.randint(0, 7, (16,), generator=g)) for _ in range(n)]


def trajectory(case):
    """(sha256 of every weight's bytes after STEPS steps, [float.hex of each step's loss]), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = ManyParts()
        opt = CASES[case](model.parameters())
        losses = []
        for ids, y in batches():
            def closure():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(ids), y)
                loss.backward()
                return loss
            losses.append(float(opt.step(closure).detach()).hex())
        digest = hashlib.sha256()
        for q in model.parameters():
            digest.update(q.detach().contiguous().numpy().tobytes())
        return digest.hexdigest(), losses
    finally:
        torch.set_num_threads(threads)


def test_the_model_tells_the_two_combinations_of_a_norm_apart():
    # what 4a542cc changed: the norm of the parts the core reduces (plugins.reductions.chunk_plan:
    # a large tensor alone, small ones flattened together) combined in float32, or in float64 with
    # the square root after. For one part both give the same number; here they must not always
    # agree, or the pins could not see such a change.
    from plugins.reductions import chunk_plan

    torch.manual_seed(0)
    model = ManyParts()
    params = list(model.parameters())
    plan = chunk_plan(params)
    assert len(params) == 26 and len({q.numel() for q in params}) >= 8 and len(plan) >= 12
    differ = 0
    for ids, y in batches():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(ids), y).backward()
        parts = torch.stack([torch.linalg.vector_norm(torch.cat([params[i].grad.reshape(-1) for i in group]))
                             for group in plan])
        in_float32 = parts.square().sum().sqrt()
        in_float64 = parts.double().square().sum().sqrt().float()
        differ += int(in_float32 != in_float64)
    assert differ >= 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_single_process_trajectory_is_pinned_bit_for_bit(case):
    version = torch.__version__.split("+")[0]
    if version != PINNED_TORCH:
        pytest.skip(f"the pins are for torch {PINNED_TORCH} (scripts/setup_env.sh, CI); this is torch "
                    f"{torch.__version__}, whose kernels may round otherwise")
    if capability() not in PINS or case not in PINS[capability()]:
        pytest.skip(f"no pin for CPU capability {capability()} (pinned: {', '.join(sorted(PINS))}): the "
                    "kernels torch picks for another CPU kind may sum in another order")
    sha, losses = trajectory(case)
    pinned_sha, pinned_losses = PINS[capability()][case]
    first = next((i for i, (a, b) in enumerate(zip(losses, pinned_losses)) if a != b), None)
    assert (sha, losses) == (pinned_sha, pinned_losses), (
        f"{case}: the numerics changed (first loss that differs: step {first}); if intended, announce it in the "
        "commit, re-measure the docs' numbers and update PINS (see this file's docstring)")


if __name__ == "__main__":  # prints the values to pin for this torch and CPU
    print(f"torch {torch.__version__}, CPU capability {capability()}", file=sys.stderr)
    for name in sorted(CASES):
        print(f"        {name!r}: {trajectory(name)!r},")
