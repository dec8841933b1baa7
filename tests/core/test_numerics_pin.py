"""SAM's and VASSO's single-process trajectories, pinned bit for bit: a change of rounding
is a decision, announced in its commit, not an accident.

Taking the norms as local sums of squares combined once in float64, with the square root
after, instead of combining float32 norms, changes the demo's weights by one float32
rounding after one update and its BLEU table by up to 0.4 after 320. The
bit-for-bit pins of tests/core/test_state_dict.py use a model of 4 small tensors whose norm
reduces in one part, where the old float32 combination and the float64 one give the same
number. This model's norms reduce in 12 parts, over 26 tensors of 1 to 65,536 elements
(the demo's transformer's in 11 or more), and the test first checks that the two
combinations differ on its gradients, so that the pins below see such a change.

If this test fails after a change of the core, the change moved the numerics. If that is
intended: say so in the commit message, re-measure what the docs report from them (the
demo's table in docs/reports/demo.md and the README's results, which a CI check compares
with a demo run, tests/scripts/test_demo_readme.py), and write the new values below for each
CPU kind in PINS (print them with ``python tests/core/test_numerics_pin.py`` on a CPU of that
kind); a kind that cannot be re-measured leaves PINS, and the commit says so.

The exact values depend on the torch build and on the CPU kernels (torch's CPU capability,
MKL's code path) and threads. The trajectories run in a new process with the kernels pinned
(plugins.lab.pinned_kernels: torch's AVX2 kernels, MKL's COMPATIBLE path, one thread), so the
pins hold on the x86-64 CPUs of the kinds they were measured on (PINS' keys: a vendor, or one
vendor's family and model), AVX2 or AVX512, for the torch that scripts/setup_env.sh installs;
with another torch (CI's compat stage runs tests/core under torch 2.1.2, the floor), where the
kernels cannot be pinned (another architecture, a CPU without AVX2) or on a CPU of another
kind, the test skips, saying so. The core keeps the float64 combination, the more accurate
one (docs/design.md).
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from plugins import SAM, VASSO
from plugins.lab import pinned_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torch.__version__ without a local part ("+cu130", "+cpu": the same CPU kernels)
PINNED_TORCH = "2.14.1"
# {CPU kind: {case: (sha256 of the weights after STEPS steps, float.hex of each step's loss)}}, under
# plugins.lab.pinned_kernels (torch's AVX2 kernels, MKL's COMPATIBLE path, one thread), torch 2.14.1.
# A kind is pinned_kernels.cpu_kind() (vendor family/model), or a vendor for all its kinds: the same
# pinned kernels round otherwise on the Intel Xeons measured than on AMD's CPUs (their first update already)
PINS = {
    "AuthenticAMD": {  # every AMD x86-64 CPU with AVX2 (an EPYC under KVM, and others)
        'SAM-AdamW': ('6b930302130d80f0fff5dc4d75cff5a072522b9207b95d72330976379570a942',
            ['0x1.2b8af00000000p+1', '0x1.f0df4a0000000p+1', '0x1.2944240000000p+2', '0x1.3143940000000p+2',
             '0x1.1f19d40000000p+2', '0x1.b3fd840000000p+1', '0x1.498ad60000000p+1', '0x1.f4e9a20000000p+0']),
        'VASSO-AdamW': ('f4046351d5d1188854e07f0019d40001809e117edb9f61e1caf5c410d53af8f4',
            ['0x1.2b8af00000000p+1', '0x1.f0df4a0000000p+1', '0x1.0dc8e20000000p+2', '0x1.f429980000000p+1',
             '0x1.f539120000000p+1', '0x1.828ee00000000p+1', '0x1.180c580000000p+2', '0x1.b3459c0000000p+1']),
        'SAM-AdamW host path': ('c0610d8f1ad202042f9905f5515ecdbea3f64962a8db12223b5ba04804622dc3',
            ['0x1.2b8af00000000p+1', '0x1.f0df740000000p+1', '0x1.2944460000000p+2', '0x1.31440c0000000p+2',
             '0x1.1da7880000000p+2', '0x1.7b15a20000000p+1', '0x1.39a0fe0000000p+1', '0x1.30dd5e0000000p+1']),
        'VASSO-AdamW host path': ('27d2b01c99a980c345eb227e2d58cec1932b54594ed06f31d17e9350865dd4af',
            ['0x1.2b8af00000000p+1', '0x1.f0df740000000p+1', '0x1.0dc8f80000000p+2', '0x1.f429f00000000p+1',
             '0x1.f539140000000p+1', '0x1.828f0e0000000p+1', '0x1.179a760000000p+2', '0x1.b367ac0000000p+1']),
    },
    "GenuineIntel 6/167": {  # the Intel Xeon (AVX512, AMX) of a 2-core KVM machine, as CI's
        'SAM-AdamW': ('9fd9b7b21871635dbc8da3c82c146a8961539e83ba1d5f95f69cf13a990e4042',
            ['0x1.2b8af00000000p+1', '0x1.f0df480000000p+1', '0x1.2944200000000p+2', '0x1.31439a0000000p+2',
             '0x1.1f0aa60000000p+2', '0x1.b59e260000000p+1', '0x1.4676c20000000p+1', '0x1.061aa40000000p+1']),
        'VASSO-AdamW': ('c819921b432e7a1866b8aff7215a6055737b67c7a08796e6d154cfd60deea9da',
            ['0x1.2b8af00000000p+1', '0x1.f0df480000000p+1', '0x1.0dc8e40000000p+2', '0x1.f4297e0000000p+1',
             '0x1.f539080000000p+1', '0x1.828ed60000000p+1', '0x1.181d7c0000000p+2', '0x1.b338560000000p+1']),
        'SAM-AdamW host path': ('b3f838b0029592155e56f895104eab2c09ac6ce806ac281d28acb540065dc554',
            ['0x1.2b8af00000000p+1', '0x1.f0df740000000p+1', '0x1.2944500000000p+2', '0x1.31440e0000000p+2',
             '0x1.1d99940000000p+2', '0x1.7b20ea0000000p+1', '0x1.3a7f680000000p+1', '0x1.3093580000000p+1']),
        'VASSO-AdamW host path': ('74ed01b8682ab6275226fb94dca50750b9a9fba248505b39da4221bc064ce03a',
            ['0x1.2b8af00000000p+1', '0x1.f0df740000000p+1', '0x1.0dc8f80000000p+2', '0x1.f429ea0000000p+1',
             '0x1.f539120000000p+1', '0x1.828f0c0000000p+1', '0x1.17a7a00000000p+2', '0x1.b36b8e0000000p+1']),
    },
}
# an Ice Lake Xeon (AVX512 without AMX) of a 2-core KVM machine, as CI's too: measured, the same bits
PINS["GenuineIntel 6/106"] = PINS["GenuineIntel 6/167"]
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


def pinned_trajectories():
    """{case: trajectory(case)} of every case, computed by this file in a new process with the
    CPU kernels pinned (they act when torch loads), and the CPU capability torch reported there."""
    env = pinned_kernels.pinned_env(dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--json"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, f"the pinned process failed (exit {out.returncode}):\n{out.stderr[-4000:]}"
    found = json.loads(out.stdout)
    return {case: tuple(value) for case, value in found["cases"].items()}, found["capability"]


@pytest.fixture(scope="module")
def pinned():
    version = torch.__version__.split("+")[0]
    if version != PINNED_TORCH:
        pytest.skip(f"the pins are for torch {PINNED_TORCH} (scripts/setup_env.sh, CI); this is torch "
                    f"{torch.__version__}, whose kernels may round otherwise")
    why = pinned_kernels.unavailable()
    if why is not None:
        pytest.skip(f"the pins are for the pinned CPU kernels, which cannot apply here: {why}")
    pins = pins_here()
    if pins is None:
        pytest.skip(f"the pins were measured on {' and '.join(PINS)} CPUs; this one is {pinned_kernels.cpu_kind()}, "
                    "whose pinned kernels may round otherwise")
    found, capability = pinned_trajectories()
    assert capability == pinned_kernels.CAPABILITY, (
        f"torch reported CPU capability {capability} under the pin, not {pinned_kernels.CAPABILITY}")
    return found, pins


def pins_here():
    """PINS' values for this CPU: its kind's, else its vendor's; None where neither was measured."""
    return PINS.get(pinned_kernels.cpu_kind()) or PINS.get(pinned_kernels.vendor())


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_single_process_trajectory_is_pinned_bit_for_bit(case, pinned):
    found, pins = pinned
    sha, losses = found[case]
    pinned_sha, pinned_losses = pins[case]
    first = next((i for i, (a, b) in enumerate(zip(losses, pinned_losses)) if a != b), None)
    assert (sha, losses) == (pinned_sha, pinned_losses), (
        f"{case}: the numerics changed (first loss that differs: step {first}); if intended, announce it in the "
        "commit, re-measure the docs' numbers and update PINS (see this file's docstring)")


def test_the_exact_numbers_are_expected_only_on_the_vendor_they_were_measured_on(monkeypatch):
    # an Intel Xeon rounds the pinned trajectories otherwise (pinned_kernels' docstring):
    # the checks of exact numbers skip there, naming the vendor, and run on the measured one
    monkeypatch.setattr(pinned_kernels, "unavailable", lambda: None)
    monkeypatch.setattr(pinned_kernels, "vendor", lambda: "GenuineIntel")
    why = pinned_kernels.unmeasured()
    assert why is not None and "GenuineIntel" in why and pinned_kernels.MEASURED_VENDORS[0] in why
    monkeypatch.setattr(pinned_kernels, "vendor", lambda: pinned_kernels.MEASURED_VENDORS[0])
    assert pinned_kernels.unmeasured() is None
    monkeypatch.setattr(pinned_kernels, "unavailable", lambda: "this machine is aarch64")
    assert pinned_kernels.unmeasured() == "this machine is aarch64"


def test_a_cpu_kind_is_its_vendor_family_and_model(tmp_path, monkeypatch):
    # PINS' keys: "model" is its own field, not the "model name" after it
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n"
                       "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 fma\n\n"
                       "processor\t: 1\nvendor_id\t: AuthenticAMD\n")
    monkeypatch.setattr(pinned_kernels, "CPUINFO", str(cpuinfo))
    assert pinned_kernels.cpu_kind() == "GenuineIntel 6/167" and pinned_kernels.vendor() == "GenuineIntel"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n")  # no family, no model
    assert pinned_kernels.cpu_kind() is None and pinned_kernels.vendor() == "AuthenticAMD"


if __name__ == "__main__":
    if sys.argv[1:] == ["--json"]:  # pinned_trajectories' process
        print(json.dumps({"capability": capability(), "cases": {name: trajectory(name) for name in sorted(CASES)}}))
    else:  # the values to pin for this torch, under the pinned kernels
        found, cap = pinned_trajectories()
        print(f"torch {torch.__version__}, CPU capability {cap} (pinned), {pinned_kernels.cpu_kind()}", file=sys.stderr)
        for name in sorted(found):
            print(f"    {name!r}: {found[name]!r},")

