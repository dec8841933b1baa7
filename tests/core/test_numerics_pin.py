"""SAM's and VASSO's single-process trajectories, pinned bit for bit: a change of rounding
is a decision, announced in its commit, not an accident.

Commit 4a542cc moved the norms to local sums of squares combined once in float64, with the
square root after. That changed the demo's weights by one float32 rounding after one
update, and its BLEU table by up to 0.4 after 320 (issue 34), and no test noticed: the
bit-for-bit pins of tests/core/test_state_dict.py use a model of 4 small tensors whose norm
reduces in one part, where the old float32 combination and the float64 one give the same
number. This model's norms reduce over 14 tensors of varied sizes (1 to 1,600 elements;
the demo's transformer has 11 or more), and the test first checks that the two
combinations differ on its gradients, so that the pins below see such a change.

If this test fails after a change of the core, the change moved the numerics. If that is
intended: say so in the commit message, re-measure what the docs report from them (the
demo's table in the README's "Results" and docs/translation.md, which a CI check compares
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
        "SAM-AdamW": ("37db784cbbcad8b6630334bc8343185e7175fdd417580ea5d8985b718ffe3f0d",
                      ["0x1.ef77a60000000p+0", "0x1.fea5780000000p+0", "0x1.06f7f60000000p+1", "0x1.063bdc0000000p+1",
                       "0x1.ef56c20000000p+0", "0x1.ea9be80000000p+0", "0x1.0cf9320000000p+1", "0x1.e1733e0000000p+0"]),
        "VASSO-AdamW": ("e32301d2146f3033e2c8086dde4db05e3ce434e29949edab359b62ba51749480",
                        ["0x1.ef77a60000000p+0", "0x1.fea5780000000p+0", "0x1.07a9920000000p+1",
                         "0x1.061a320000000p+1", "0x1.f0f3120000000p+0", "0x1.ebbae60000000p+0",
                         "0x1.0e284a0000000p+1", "0x1.dfd8260000000p+0"]),
    },
}
STEPS = 8


def capability():
    get = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return get() if get else "unknown"


class ManyParts(torch.nn.Module):
    """Token ids -> mean-pooled embedding -> 3 hidden layers with LayerNorm -> 7 classes, and a
    learned output temperature: 14 parameter tensors of 1 to 1,600 elements."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 24)
        self.inp = torch.nn.Linear(24, 40)
        self.norm1 = torch.nn.LayerNorm(40)
        self.hidden = torch.nn.Linear(40, 40)
        self.norm2 = torch.nn.LayerNorm(40)
        self.hidden2 = torch.nn.Linear(40, 40)
        self.out = torch.nn.Linear(40, 7)
        self.temperature = torch.nn.Parameter(torch.ones(()))

    def forward(self, ids):
        h = self.embed(ids).mean(1)
        h = torch.tanh(self.norm1(self.inp(h)))
        h = torch.tanh(self.norm2(self.hidden(h)))
        h = torch.tanh(self.hidden2(h))
        return self.out(h) * self.temperature


CASES = {
    "SAM-AdamW": lambda ps: SAM(ps, torch.optim.AdamW, rho=0.1, lr=1e-2, weight_decay=1e-4, betas=(0.9, 0.98)),
    "VASSO-AdamW": lambda ps: VASSO(ps, torch.optim.AdamW, rho=0.1, theta=0.4, lr=1e-2, weight_decay=1e-4,
                                    betas=(0.9, 0.98)),
}


def batches(n=STEPS):
    g = torch.Generator().manual_seed(34)
    return [(torch.randint(0, 50, (16, 5), generator=g), torch.randint(0, 7, (16,), generator=g)) for _ in range(n)]


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
    # what 4a542cc changed: per-tensor sums of squares combined in float32, or in float64 with
    # the square root after. On one tensor both give the same number; here they must not all
    # agree, or the pins could not see such a change.
    torch.manual_seed(0)
    model = ManyParts()
    params = list(model.parameters())
    assert len(params) == 14 and len({q.numel() for q in params}) >= 5
    differ = 0
    for ids, y in batches():
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(ids), y).backward()
        parts = [q.grad.pow(2).sum() for q in params]
        in_float32 = torch.stack(parts).sum().sqrt()
        in_float64 = torch.stack(parts).double().sum().sqrt().float()
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
