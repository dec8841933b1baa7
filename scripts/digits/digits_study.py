"""Shared pieces of the CPU-scale experiments on scikit-learn's bundled UCI digits
(``sklearn.datasets.load_digits``: 1,797 8x8 grey images, 10 classes, no download).

Used by ``experiments.py`` beside it (label noise, generalization for computation,
Hessian spectrum) and by tests/digits; not installed with the package: it needs
numpy, and scikit-learn for the data.

Choices, written down once:

* split: a fixed stratified 70/30 split (``SPLIT_SEED = 0``): 1,257 training and
  540 test images, identical for every method and seed; pixels scaled to [0, 1].
* label noise: exactly ``round(fraction * n)`` training labels, chosen at random, are
  replaced by a label drawn uniformly from the *other* 9 classes (symmetric noise,
  every flipped label is wrong); test labels stay clean. The draw depends on the
  run's seed, so each seed sees a different noisy training set.
* network: by default an MLP 64-256-256-10 with ReLU (85,002 parameters); ``cnn``
  is a small CNN (two 3x3 convolutions with 16 and 32 channels, 2x2 max-pool, a
  64-unit hidden layer; 38,282 parameters) that costs about 3x the CPU time per
  epoch. Neither has BatchNorm or dropout, so the training loss is a deterministic
  function of the weights (what the Hessian routine differentiates).
* training: SGD with momentum 0.9 and weight decay 5e-4, cosine learning-rate
  decay, batch 64 (as the paper's CIFAR recipe, scaled down); SAM / VASSO wrap the
  same SGD through :mod:`plugins`.
* the Hessian routine: Lanczos with full re-orthogonalisation on exact
  Hessian-vector products (double backward through ``torch.autograd``) of the
  *full* training loss (mean cross-entropy over all training images, no weight
  decay term), returning the largest algebraic eigenvalues.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from plugins import SAM, VASSO
from plugins.lab.tables import fmt_mean_std, markdown_table, mean_std

SPLIT_SEED = 0
TEST_FRACTION = 0.3
NUM_CLASSES = 10


# ---------------------------------------------------------------------------- data

def load_digits_arrays():
    """``(images float32 [N, 8, 8] in [0, 1], labels int64 [N])`` of all 1,797 digits."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (d.images / 16.0).astype(np.float32)
    return images, d.target.astype(np.int64)


def split_indices(labels: np.ndarray, test_fraction: float = TEST_FRACTION, seed: int = SPLIT_SEED):
    """Stratified ``(train_idx, test_idx)``, sorted, a pure function of ``(labels, seed)``."""
    rng = np.random.RandomState(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def flip_labels(labels: np.ndarray, fraction: float, seed: int, num_classes: int = NUM_CLASSES):
    """A copy of ``labels`` with ``round(fraction * n)`` entries, chosen at random,
    replaced by a uniformly drawn *different* class; returns ``(noisy, flipped_mask)``."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
    rng = np.random.RandomState(10_000 + seed)
    n = len(labels)
    k = int(round(fraction * n))
    chosen = rng.choice(n, size=k, replace=False)
    noisy = labels.copy()
    shift = rng.randint(1, num_classes, size=k)  # 1..C-1: never the true class
    noisy[chosen] = (labels[chosen] + shift) % num_classes
    mask = np.zeros(n, dtype=bool)
    mask[chosen] = True
    return noisy, mask


@dataclass
class DigitsData:
    x_train: torch.Tensor  # [n, 1, 8, 8]
    y_train: torch.Tensor  # possibly noisy
    x_test: torch.Tensor
    y_test: torch.Tensor   # clean
    y_train_clean: torch.Tensor


def make_data(noise: float = 0.0, seed: int = 0) -> DigitsData:
    images, labels = load_digits_arrays()
    tr, te = split_indices(labels)
    y_tr = labels[tr]
    y_noisy = flip_labels(y_tr, noise, seed)[0] if noise > 0 else y_tr.copy()
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    return DigitsData(t(images[tr][:, None]), t(y_noisy), t(images[te][:, None]), t(labels[te]), t(y_tr))


# ---------------------------------------------------------------------------- model

class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 16, hidden: int = 64):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MLP(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, width: int = 256):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(),
                                 nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))

    def forward(self, x):
        return self.net(x)


MODELS = {"mlp": MLP, "cnn": SmallCNN}


# ---------------------------------------------------------------------------- methods

@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "sgd" | "sam" | "vasso"
    theta: Optional[float] = None
    p: float = 1.0


def build_optimizer(method: Method, model: nn.Module, *, lr: float, rho: float, seed: int,
                    momentum: float = 0.9, weight_decay: float = 5e-4):
    kw = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
    if method.kind == "sgd":
        return torch.optim.SGD(model.parameters(), **kw)
    if method.kind == "sam":
        return SAM(model.parameters(), torch.optim.SGD, rho=rho, p=method.p, seed=seed, **kw)
    if method.kind == "vasso":
        return VASSO(model.parameters(), torch.optim.SGD, rho=rho, theta=method.theta, p=method.p,
                     seed=seed, **kw)
    raise ValueError(f"unknown method kind {method.kind!r}")


@dataclass
class RunResult:
    test_acc: float
    train_acc_clean: float
    epoch_times: List[float]       # wall clock
    epoch_cpu_times: List[float]   # this process's CPU time (robust to other jobs on the machine)
    two_pass_fraction: float
    model: nn.Module = field(repr=False)

    @property
    def time_per_epoch(self) -> float:
        # the first epoch carries one-off warm-up costs: leave it out when there are others
        times = self.epoch_times[1:] if len(self.epoch_times) > 1 else self.epoch_times
        return float(np.mean(times))

    @property
    def cpu_time_per_epoch(self) -> float:
        times = self.epoch_cpu_times[1:] if len(self.epoch_cpu_times) > 1 else self.epoch_cpu_times
        return float(np.mean(times))


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def train(method: Method, data: DigitsData, *, seed: int, epochs: int, lr: float = 0.05,
          rho: float = 0.05, batch_size: int = 64, model_fn: Callable[[], nn.Module] = MLP) -> RunResult:
    """Train one model; every random choice (init, batch order, eSAM/eVASSO coin) follows ``seed``."""
    torch.manual_seed(seed)
    model = model_fn()
    opt = build_optimizer(method, model, lr=lr, rho=rho, seed=seed)
    base = getattr(opt, "base_optimizer", opt)
    steps_per_epoch = math.ceil(len(data.y_train) / batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(base, T_max=epochs * steps_per_epoch)
    gen = torch.Generator().manual_seed(seed)
    x, y = data.x_train, data.y_train
    n = len(y)
    times, cpu_times, two_pass, steps = [], [], 0, 0
    for _ in range(epochs):
        model.train()
        t0, c0 = time.perf_counter(), time.process_time()
        perm = torch.randperm(n, generator=gen)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            xb, yb = x[idx], y[idx]

            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(xb), yb)
                loss.backward()
                return loss

            if method.kind == "sgd":
                closure()
                opt.step()
            else:
                opt.step(closure)
                two_pass += int(opt.diagnostics["two_pass"])
            sched.step()
            steps += 1
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
    frac = two_pass / steps if method.kind != "sgd" else 0.0
    return RunResult(accuracy(model, data.x_test, data.y_test),
                     accuracy(model, data.x_train, data.y_train_clean), times, cpu_times, frac, model)


# ---------------------------------------------------------------------------- Hessian

def full_loss_hvp(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int = 0):
    """``(hvp, n)``: ``hvp(v)`` is the product of the Hessian of the mean cross-entropy
    over ``(x, y)`` with the flat vector ``v`` (``n`` = number of parameters).

    Exact (double backward).  ``chunk > 0`` evaluates the loss in chunks of that many
    samples and sums, weighted, to bound memory; the result is the same Hessian."""
    params = [q for q in model.parameters() if q.requires_grad]
    n = sum(q.numel() for q in params)
    model.eval()
    pieces = [(x, y)] if chunk <= 0 else [(x[i:i + chunk], y[i:i + chunk]) for i in range(0, len(y), chunk)]
    total = len(y)

    def hvp(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(n, dtype=v.dtype)
        vs, o = [], 0
        for q in params:
            vs.append(v[o:o + q.numel()].view_as(q).to(q.dtype))
            o += q.numel()
        for xb, yb in pieces:
            loss = F.cross_entropy(model(xb), yb, reduction="sum") / total
            grads = torch.autograd.grad(loss, params, create_graph=True)
            dot = sum((g * u).sum() for g, u in zip(grads, vs))
            hv = torch.autograd.grad(dot, params)
            out += torch.cat([h.reshape(-1) for h in hv]).to(v.dtype)
        return out

    return hvp, n


def lanczos(matvec: Callable[[torch.Tensor], torch.Tensor], n: int, iters: int, seed: int = 0,
            dtype=torch.float64) -> torch.Tensor:
    """Ritz values (ascending) of a symmetric operator after ``iters`` Lanczos steps with
    full re-orthogonalisation; ``iters >= n`` gives every eigenvalue (to rounding).

    The extreme Ritz values converge first: with a few dozen steps the top five of a
    network's Hessian are accurate to a fraction of a percent (checked in
    ``tests/digits/test_digits.py`` against ``torch.linalg.eigvalsh``)."""
    m = min(iters, n)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, generator=g, dtype=dtype)
    q /= q.norm()
    Q = torch.zeros(m, n, dtype=dtype)
    alpha = torch.zeros(m, dtype=dtype)
    beta = torch.zeros(m, dtype=dtype)
    k = m
    for j in range(m):
        Q[j] = q
        w = matvec(q).to(dtype)
        alpha[j] = w @ q
        # full re-orthogonalisation, twice (classical Gram-Schmidt is unstable once)
        for _ in range(2):
            w = w - Q[: j + 1].T @ (Q[: j + 1] @ w)
        if j + 1 < m:
            b = w.norm()
            beta[j] = b
            if b <= 1e-10 * max(1.0, float(alpha[: j + 1].abs().max())):
                k = j + 1  # invariant subspace found: the Ritz values are exact
                break
            q = w / b
    T = torch.diag(alpha[:k]) + torch.diag(beta[: k - 1], 1) + torch.diag(beta[: k - 1], -1)
    return torch.linalg.eigvalsh(T)


def top_eigenvalues(model: nn.Module, x: torch.Tensor, y: torch.Tensor, k: int = 5, iters: int = 80,
                    seed: int = 0, chunk: int = 0) -> List[float]:
    """The ``k`` largest (algebraic) Hessian eigenvalues of the full training loss, descending."""
    hvp, n = full_loss_hvp(model, x, y, chunk=chunk)
    ritz = lanczos(hvp, n, iters, seed=seed)
    return [float(v) for v in ritz.flip(0)[:k]]


# ---------------------------------------------------------------------------- tables

def set_threads(n: int) -> None:
    """Pin torch's intra-op threads (the experiments are written for 2 cores and use 1
    thread each by default: these models are too small to gain from more)."""
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


# --------------------------------------------------------------------- the paper's tables

PAPER_LBNOISE = {  # tab.lbnoise: CIFAR-10 (ResNet-18), test accuracy (%)
    "columns": ["SAM", "VASSO (θ=0.9)", "VASSO (θ=0.4)", "VASSO (θ=0.2)"],
    "rows": {
        0.25: ["96.39 ± 0.12", "96.36 ± 0.11", "96.42 ± 0.12", "**96.48** ± 0.09"],
        0.50: ["93.93 ± 0.21", "94.00 ± 0.24", "94.63 ± 0.21", "**94.93** ± 0.16"],
        0.75: ["75.36 ± 0.42", "77.40 ± 0.37", "80.94 ± 0.40", "**85.02** ± 0.39"],
    },
}

PAPER_RVASSO = [  # tab.rvasso, CIFAR-10 / ResNet-18: accuracy, epoch runtime (s), ratio
    ("SGD", "96.25 ± 0.05", "14.42", "1x"),
    ("SAM", "96.58 ± 0.10", "27.62", "1.92x"),
    ("eSAM (p=0.5)", "96.54 ± 0.11", "21.57", "1.49x"),
    ("eVASSO (p=0.5)", "96.72 ± 0.14", "21.94", "1.52x"),
    ("eSAM (p=0.3)", "96.42 ± 0.08", "18.34", "1.27x"),
    ("eVASSO (p=0.3)", "96.69 ± 0.06", "18.61", "1.29x"),
]

PAPER_SPECTRA = {  # tab.spectra: ResNet-18 on CIFAR-10
    "columns": ["SGD", "SAM", "VASSO", "eVASSO"],
    "lambda_1": ["82.52", "26.40", "**23.32**", "25.21"],
    "lambda_1/lambda_5": ["16.63", "2.12", "**1.86**", "2.03"],
}

# --------------------------------------------------------------------- method lists

def labelnoise_methods(with_sgd: bool = True):
    ms = [Method("SGD", "sgd")] if with_sgd else []
    return ms + [Method("SAM", "sam"),
                 Method("VASSO (θ=0.9)", "vasso", theta=0.9),
                 Method("VASSO (θ=0.4)", "vasso", theta=0.4),
                 Method("VASSO (θ=0.2)", "vasso", theta=0.2)]


def tradeoff_methods(theta: float):
    return [Method("SGD", "sgd"),
            Method("SAM", "sam"),
            Method("eSAM (p=0.5)", "sam", p=0.5),
            Method("eVASSO (p=0.5)", "vasso", theta=theta, p=0.5),
            Method("eSAM (p=0.3)", "sam", p=0.3),
            Method("eVASSO (p=0.3)", "vasso", theta=theta, p=0.3)]


def spectra_methods(theta: float, p: float):
    return [Method("SGD", "sgd"),
            Method("SAM", "sam"),
            Method("VASSO", "vasso", theta=theta),
            Method(f"eVASSO (p={p:g})", "vasso", theta=theta, p=p)]


# --------------------------------------------------------------------- table builders

def labelnoise_table(results, noises, methods, seeds):
    """Markdown table: a row per noise level, a column per method (test accuracy %)."""
    header = ["label noise"] + [m for m in methods]
    rows = []
    for noise in noises:
        row = [f"{round(noise * 100)}%"]
        for m in methods:
            accs = [r["test_acc"] for r in results if r["noise"] == noise and r["method"] == m]
            row.append(fmt_mean_std(accs, 2, 100.0) if accs else "-")
        rows.append(row)
    return markdown_table(header, rows)


def paper_labelnoise_table():
    header = ["label noise (paper, CIFAR-10)"] + PAPER_LBNOISE["columns"]
    rows = [[f"{round(k * 100)}%"] + v for k, v in PAPER_LBNOISE["rows"].items()]
    return markdown_table(header, rows)


def tradeoff_table(results, methods):
    """Markdown table per method: accuracy %, CPU and wall time per epoch (s), the CPU
    time's ratio over SGD's, and the fraction of two-pass steps.

    The ratio uses this process's CPU time, which other jobs on a shared machine
    disturb far less than the wall clock (both are printed)."""
    def col(m, key):
        return [r[key] for r in results if r["method"] == m]

    sgd = col("SGD", "cpu_time_per_epoch")
    sgd_mean = mean_std(sgd)[0] if sgd else float("nan")
    rows = []
    for m in methods:
        accs, cpu, wall = col(m, "test_acc"), col(m, "cpu_time_per_epoch"), col(m, "time_per_epoch")
        twop = col(m, "two_pass_fraction")
        cm = mean_std(cpu)[0] if cpu else float("nan")
        rows.append([m, fmt_mean_std(accs, 2, 100.0) if accs else "-",
                     f"{cm:.3f}" if cpu else "-",
                     f"{mean_std(wall)[0]:.3f}" if wall else "-",
                     f"{cm / sgd_mean:.2f}x" if cpu and sgd else "-",
                     f"{mean_std(twop)[0]:.2f}" if twop else "-"])
    return markdown_table(["method", "test accuracy (%)", "CPU time / epoch (s)", "wall time / epoch (s)",
                             "ratio over SGD (CPU time)", "two-pass steps"], rows)


def paper_tradeoff_table():
    return markdown_table(["method (paper, CIFAR-10 ResNet-18)", "accuracy (%)", "epoch runtime (s)",
                             "ratio"], [list(r) for r in PAPER_RVASSO])


def spectra_table(results, methods):
    rows_l1, rows_ratio, rows_acc = ["λ_1"], ["λ_1/λ_5"], ["test accuracy (%)"]
    for m in methods:
        rs = [r for r in results if r["method"] == m]
        rows_l1.append(fmt_mean_std([r["eigs"][0] for r in rs], 2) if rs else "-")
        rows_ratio.append(fmt_mean_std([r["eigs"][0] / r["eigs"][4] for r in rs], 2) if rs else "-")
        rows_acc.append(fmt_mean_std([r["test_acc"] for r in rs], 2, 100.0) if rs else "-")
    return markdown_table([""] + list(methods), [rows_l1, rows_ratio, rows_acc])


def paper_spectra_table():
    return markdown_table(["(paper, CIFAR-10 ResNet-18)"] + PAPER_SPECTRA["columns"],
                            [["λ_1"] + PAPER_SPECTRA["lambda_1"],
                             ["λ_1/λ_5"] + PAPER_SPECTRA["lambda_1/lambda_5"]])
