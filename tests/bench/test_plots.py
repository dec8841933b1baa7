"""The diagnostics PNG (vasso-plot, plugins.lab.plot) has the series it should, and the sphere
illustration's math."""

import subprocess
import sys

import numpy as np
import pytest

from bench_samples import CONFIG


def _png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    return data


def _fake_log(stab, gap, optimizer):
    cfg = CONFIG.replace("'_name': 'vasso'", f"'_name': '{optimizer}'").replace("'perturb_prob': 0.5",
                                                                                 "'perturb_prob': 1.0")
    lines = [cfg]
    for i, (s, g) in enumerate(zip(stab, gap)):
        lines.append(f"2026 | INFO | train_inner | epoch 001:  {i} / 9 loss=9.0, ups=3, num_updates={10 * (i + 1)}, "
                     f"ascent_norm=0.1, loss_gap={g}, sharpness=0.1, stability={s}, two_pass=1, rho=0.1, wall=1")
    return "\n".join(lines) + "\n"


def test_plot_has_sam_and_vasso_on_the_same_axes(diag, tmp_path):
    (tmp_path / "sam.log").write_text(_fake_log([0.12, 0.13, 0.14], [0.2, 0.1, 0.05], "sam"))
    (tmp_path / "vasso.log").write_text(_fake_log([0.05, 0.06, 0.07], [0.19, 0.09, 0.04], "vasso"))
    runs = [diag.load_run(str(tmp_path / "sam.log")), diag.load_run(str(tmp_path / "vasso.log"))]
    out = tmp_path / "plots" / "d.png"
    drawn = diag.plot_runs(runs, str(out))
    _png(out)
    assert set(drawn) == {"stability", "loss_gap"}
    sam_label, vasso_label = runs[0].label, runs[1].label
    assert sam_label.startswith("SAM") and vasso_label.startswith("VASSO (θ=0.4")
    assert drawn["stability"][sam_label] == ([10.0, 20.0, 30.0], [0.12, 0.13, 0.14])
    assert drawn["stability"][vasso_label] == ([10.0, 20.0, 30.0], [0.05, 0.06, 0.07])
    assert drawn["loss_gap"][vasso_label][1] == [0.19, 0.09, 0.04]


def test_cli_smoothing_and_missing_data(diag, tmp_path, capsys):
    (tmp_path / "a.log").write_text(_fake_log([0.1, 0.3, 0.5], [0.1, 0.1, 0.1], "sam"))
    (tmp_path / "adam.log").write_text("2026 | INFO | train_inner | epoch 001:  1 / 9 loss=9.0, num_updates=1\n")
    out = tmp_path / "o.png"
    assert diag.main([str(tmp_path / "a.log"), f"AdamW={tmp_path / 'adam.log'}", "-o", str(out), "--smooth", "2"]) == 0
    _png(out)
    text = capsys.readouterr()
    assert "| SAM (ρ=0.1) | fairseq | 3 |" in text.out and "AdamW: no stability" in text.err
    assert diag._smooth([0.1, 0.3, 0.5], 2) == pytest.approx([0.1, 0.2, 0.4])
    assert diag.main([f"AdamW={tmp_path / 'adam.log'}", "-o", str(tmp_path / "e.png")]) == 1


def test_sphere_noise_scale_and_adversaries(sphere):
    g2 = float(np.dot(sphere.GRAD, sphere.GRAD))
    for snr in sphere.SNRS:
        c = sphere.noise_scale(snr)
        assert g2 / (c * sum(sphere.NOISE_SHAPE)) == pytest.approx(snr)
    adv = sphere.adversaries(1.0, 100, theta=0.4, rho=0.5, seed=3)
    for key in ("sam", "vasso"):
        assert adv[key].shape == (100, 3)
        assert np.linalg.norm(adv[key], axis=1) == pytest.approx(np.full(100, 0.5))
    # theta = 1: the moving average is the gradient itself, VASSO == SAM
    same = sphere.adversaries(0.1, 50, theta=1.0, seed=1)
    assert np.allclose(same["sam"], same["vasso"])


def test_sphere_vasso_steadier_and_png(sphere, tmp_path):
    adv = sphere.adversaries(1.0, 100, theta=0.4, seed=0)
    sam, vasso = sphere.spread(adv["sam"]), sphere.spread(adv["vasso"])
    assert vasso["stability"] < sam["stability"] and vasso["angle"] < sam["angle"]
    out = tmp_path / "s.png"
    rows = sphere.plot(str(out), snrs=(5.0, 0.01), n=20)
    _png(out)
    assert [(r["snr"], r["method"].split()[0]) for r in rows] == [(5.0, "SAM"), (5.0, "VASSO"), (0.01, "SAM"),
                                                                  (0.01, "VASSO")]


def test_the_core_never_imports_the_plots_and_they_import_matplotlib_only_to_draw():
    code = ("import sys, plugins; assert 'plugins.lab.plot' not in sys.modules, 'core imported plugins.lab.plot'; "
            "import plugins.lab.plot.diagnostics, plugins.lab.plot.sphere; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported before a plot'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_vasso_plot_command_help():
    """python -m plugins.lab.plot is the vasso-plot console script's main."""
    proc = subprocess.run([sys.executable, "-m", "plugins.lab.plot", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "usage: vasso-plot" in proc.stdout and "results.jsonl" in proc.stdout
    missing = subprocess.run([sys.executable, "-m", "plugins.lab.plot", "no/such/train.log"], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1] == (
        "vasso-plot: error: runs: no such file or folder: no/such/train.log")


def test_the_plots_refuse_an_existing_png_without_force(tmp_path, sphere):
    """A figure the user has is not drawn over without --force, before any work (exit 2,
    naming the flag); with --force it is."""
    png = tmp_path / "adversaries.png"
    png.write_bytes(b"the user's figure")
    with pytest.raises(SystemExit) as stop:
        sphere.main(["-o", str(png), "-n", "5"])
    assert stop.value.code == 2 and png.read_bytes() == b"the user's figure"
    assert sphere.main(["-o", str(png), "-n", "5", "--force"]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    plot = subprocess.run([sys.executable, "-m", "plugins.lab.plot", "no_run.log", "-o", str(png)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 2 and plot.stderr.strip().splitlines()[-1] == (
        f"vasso-plot: error: --out {png} exists: give a new file, or --force to overwrite it")
