"""The pieces of the digits experiments (scripts/digits/digits_study.py, and the recipe
scripts/digits/experiments.py run as a command): data split and label-noise determinism, the Lanczos
Hessian routine against torch.linalg.eigvalsh, table formatting, and a 1-epoch run of
each experiment's code path."""

import json
import os
import sys

import numpy as np
import process_group
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import digits_study as C

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = os.path.join(ROOT, "scripts", "digits", "experiments.py")


# ------------------------------------------------------------------ data

def test_split_is_fixed_stratified_and_disjoint():
    images, labels = C.load_digits_arrays()
    assert images.shape == (1797, 8, 8) and images.min() >= 0 and images.max() <= 1
    tr, te = C.split_indices(labels)
    tr2, te2 = C.split_indices(labels)
    assert np.array_equal(tr, tr2) and np.array_equal(te, te2)
    assert len(set(tr) & set(te)) == 0 and len(tr) + len(te) == 1797
    # stratified: every class is ~30% test
    for c in range(10):
        frac = np.sum(labels[te] == c) / np.sum(labels == c)
        assert abs(frac - 0.3) < 0.01
    assert not np.array_equal(C.split_indices(labels, seed=1)[1], te)


@pytest.mark.parametrize("fraction", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_flip_labels_exact_fraction_always_wrong_and_deterministic(fraction):
    labels = np.random.RandomState(3).randint(0, 10, size=1000)
    noisy, mask = C.flip_labels(labels, fraction, seed=7)
    noisy2, mask2 = C.flip_labels(labels, fraction, seed=7)
    assert np.array_equal(noisy, noisy2) and np.array_equal(mask, mask2)
    assert mask.sum() == round(fraction * 1000)
    assert np.all(noisy[mask] != labels[mask]) and np.all(noisy[~mask] == labels[~mask])
    assert noisy.min() >= 0 and noisy.max() <= 9
    if 0 < fraction < 1:
        other, _ = C.flip_labels(labels, fraction, seed=8)
        assert not np.array_equal(other, noisy)
        # the wrong labels are spread over the other classes
        shifts = (noisy[mask] - labels[mask]) % 10
        assert set(np.unique(shifts)) == set(range(1, 10))


def test_flip_labels_rejects_bad_fraction():
    with pytest.raises(ValueError):
        C.flip_labels(np.zeros(5, dtype=int), 1.5, seed=0)


def test_make_data_noise_only_on_training_labels():
    clean = C.make_data(0.0, 0)
    noisy = C.make_data(0.5, 0)
    assert torch.equal(clean.x_train, noisy.x_train) and torch.equal(clean.y_test, noisy.y_test)
    assert torch.equal(noisy.y_train_clean, clean.y_train)
    assert abs(float((noisy.y_train != noisy.y_train_clean).float().mean()) - 0.5) < 1e-3
    assert clean.x_train.shape[1:] == (1, 8, 8)


# ------------------------------------------------------------------ Hessian

class TinyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _exact_hessian(model, x, y):
    params = list(model.parameters())
    shapes = [q.shape for q in params]
    flat0 = torch.cat([q.detach().reshape(-1) for q in params])

    def loss_of(flat):
        out, o = {}, 0
        for (name, q), s in zip(model.named_parameters(), shapes):
            out[name] = flat[o:o + q.numel()].view(s)
            o += q.numel()
        return F.cross_entropy(torch.func.functional_call(model, out, (x,)), y)

    return torch.func.hessian(loss_of)(flat0)  # forward-over-reverse, vectorized


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyMLP().double()
    x = torch.randn(40, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    return model, x, y


def test_hvp_matches_exact_hessian(tiny):
    model, x, y = tiny
    H = _exact_hessian(model, x, y)
    hvp, n = C.full_loss_hvp(model, x, y)
    assert n == H.shape[0] == 6 * 5 + 5 + 5 * 3 + 3
    v = torch.randn(n, dtype=torch.float64)
    torch.testing.assert_close(hvp(v), H @ v, rtol=1e-10, atol=1e-12)
    hvp_chunked, _ = C.full_loss_hvp(model, x, y, chunk=7)  # same Hessian, summed in chunks
    torch.testing.assert_close(hvp_chunked(v), H @ v, rtol=1e-10, atol=1e-12)


def test_lanczos_full_gives_every_eigenvalue(tiny):
    model, x, y = tiny
    H = _exact_hessian(model, x, y)
    exact = torch.linalg.eigvalsh(H)
    hvp, n = C.full_loss_hvp(model, x, y)
    ritz = C.lanczos(hvp, n, iters=n, seed=1)
    # the Lanczos basis may close early (H has repeated/zero eigenvalues): the top ones must agree
    top = ritz.flip(0)[:5]
    torch.testing.assert_close(top, exact.flip(0)[:5], rtol=1e-6, atol=1e-9)


def test_top_eigenvalues_of_the_cnn_against_eigvalsh():
    """A few dozen Lanczos steps on the experiments' own routine find the top five
    eigenvalues of a small CNN's exact Hessian."""
    torch.manual_seed(0)
    model = C.SmallCNN(width=1, hidden=4).double()  # 10 + 20 + 132 + 50 = 212 params
    data = C.make_data(0.0, 0)
    x, y = data.x_train[:60].double(), data.y_train[:60]
    H = _exact_hessian(model, x, y)
    exact = torch.linalg.eigvalsh(H).flip(0)[:5]
    got = torch.tensor(C.top_eigenvalues(model, x, y, k=5, iters=80, seed=0), dtype=torch.float64)
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-8)
    assert got[0] >= got[4]


def test_lanczos_on_a_known_matrix():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(200, 200, generator=g, dtype=torch.float64))
    eig = torch.cat([torch.tensor([50.0, 30.0, 20.0, 12.0, 10.0], dtype=torch.float64),
                     torch.linspace(-1, 1, 195, dtype=torch.float64)])
    A = Q @ torch.diag(eig) @ Q.T
    ritz = C.lanczos(lambda v: A @ v, 200, iters=40, seed=0)
    torch.testing.assert_close(ritz.flip(0)[:5], eig[:5], rtol=1e-8, atol=1e-8)


# ------------------------------------------------------------------ tables

def test_markdown_table_and_mean_std():
    """plugins.lab.tables: the one mean ± std and table writer every tool uses."""
    from plugins.lab import tables

    assert C.fmt_mean_std is tables.fmt_mean_std and C.markdown_table is tables.markdown_table
    assert tables.fmt_mean_std([0.9, 0.92, 0.94], 2, 100.0) == "92.00 ± 2.00"
    assert tables.fmt_mean_std([1.0], 1) == "1.0"  # one seed: no spread to show
    assert tables.fmt_mean_std([None, 2.0, None, 4.0], 1) == "3.0 ± 1.4"  # missing values skipped
    assert tables.fmt_mean_std([None]) == "-" and tables.mean_std([]) == (None, None)
    t = tables.markdown_table(["a", "b"], [["x", "1"], ["y", "2"]])
    assert t.splitlines() == ["| a | b |", "|:---|---:|", "| x | 1 |", "| y | 2 |"]
    t = tables.markdown_table(["a", "b", "c"], [[1, 2, 3]], align="-cr", title="T")
    assert t.splitlines() == ["### T", "", "| a | b | c |", "|---|:---:|---:|", "| 1 | 2 | 3 |"]
    with pytest.raises(ValueError, match="has 1 cells"):
        tables.markdown_table(["a", "b"], [["x"]])
    with pytest.raises(ValueError, match="align"):
        tables.markdown_table(["a", "b"], [], align="lx")


def test_experiment_tables_layout():
    res = [{"noise": 0.5, "seed": s, "method": m, "test_acc": a}
           for s, (m, a) in enumerate([("SAM", 0.8), ("SAM", 0.9), ("VASSO (θ=0.2)", 0.85)])]
    t = C.labelnoise_table(res, [0.5, 0.75], ["SAM", "VASSO (θ=0.2)"], [0, 1])
    lines = t.splitlines()
    assert lines[0] == "| label noise | SAM | VASSO (θ=0.2) |"
    assert lines[2] == "| 50% | 85.00 ± 7.07 | 85.00 |"
    assert lines[3] == "| 75% | - | - |"
    tr = [{"method": "SGD", "test_acc": 0.9, "time_per_epoch": 1.0, "cpu_time_per_epoch": 1.0,
           "two_pass_fraction": 0.0},
          {"method": "SAM", "test_acc": 0.95, "time_per_epoch": 2.5, "cpu_time_per_epoch": 2.0,
           "two_pass_fraction": 1.0}]
    t = C.tradeoff_table(tr, ["SGD", "SAM"])
    assert "| SAM | 95.00 | 2.000 | 2.500 | 2.00x | 1.00 |" in t
    sp = [{"method": "SGD", "test_acc": 0.9, "eigs": [10.0, 5, 4, 3, 2.0]}]
    t = C.spectra_table(sp, ["SGD", "SAM"])
    assert "| λ_1 | 10.00 | - |" in t and "| λ_1/λ_5 | 5.00 | - |" in t
    for paper in (C.paper_labelnoise_table(), C.paper_tradeoff_table(), C.paper_spectra_table()):
        assert paper.count("\n") >= 3


# ------------------------------------------------------------------ one epoch of each experiment

@pytest.mark.parametrize("argv", [
    ["labelnoise", "--epochs", "1", "--seeds", "0", "--noise", "0.5"],
    ["tradeoff", "--epochs", "1", "--seeds", "0"],
    ["spectra", "--epochs", "1", "--seeds", "0", "--lanczos-iters", "8"],
])
def test_each_experiment_runs_one_epoch(argv, tmp_path):
    out = tmp_path / "r.json"
    proc = process_group.run([sys.executable, EXPERIMENTS] + argv + ["--json", str(out)], capture_output=True,
                             text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout
    assert "Paper (tab." in printed and "mean ± std over seeds [0]" in printed
    saved = json.loads(out.read_text())
    results = saved["results"]
    assert saved["experiment"] == argv[0] and len(results) > 0
    for r in results:
        assert 0.0 <= r["test_acc"] <= 1.0
    if argv[0] == "tradeoff":
        frac = {r["method"]: r["two_pass_fraction"] for r in results}
        assert frac["SGD"] == 0.0 and frac["SAM"] == 1.0 and 0.0 < frac["eSAM (p=0.3)"] < 1.0
    if argv[0] == "spectra":
        for r in results:
            assert len(r["eigs"]) == 5 and r["eigs"][0] >= r["eigs"][4]


def test_training_is_reproducible():
    data = C.make_data(0.25, 1)
    m = C.Method("eVASSO", "vasso", theta=0.4, p=0.5)
    a = C.train(m, data, seed=3, epochs=1)
    b = C.train(m, data, seed=3, epochs=1)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    assert a.test_acc == b.test_acc and a.two_pass_fraction == b.two_pass_fraction
