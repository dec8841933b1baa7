"""The GPU check's offline install, rehearsed on this machine: ``scripts/test_gpu.sh --wheelhouse
DIR --install-only`` with the network cut (``unshare -n``), then the environment it made imports
the plugins and runs one VASSO step.

What it proves: the path a user walks on a node without network, from a wheelhouse to a venv
over the node's torch, end to end: pip installs from DIR alone (no index, no network, no pip
configuration), every package of DIR/requirements.txt lands in the venv and is the copy imported
there, even where the node's Python has its own copy (this machine's environment has them all,
as the node of the issue that reported the install proving nothing had); the script lists them;
a failed set-up leaves no venv behind, and a folder the script did not make is never replaced.

What it does not: the wheelhouse here is small and built by this test (this project's wheel from
a copy of the checkout, and three pure-Python packages of the project's extras, submitit,
cloudpickle and parameterized, repacked from this environment's installed files, as pip
installed them), not by scripts/wheelhouse.sh, whose resolution needs the network and whose
fairseq build takes minutes; the heavy stack (torch, fairseq and the rest of the extras) is this
environment's, standing in for the node's. Nor does it run anything on a GPU.
"""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import process_group
import pytest
from checkout import REPO, copy_clone

TEST_GPU = os.path.join(REPO, "scripts", "test_gpu.sh")
#: The wheelhouse's packages besides this project: pure Python, in the project's extras (slurm, test)
SMALL = ("submitit", "cloudpickle", "parameterized")


def _network_cut():
    """The command prefix that runs a command without network (a namespace with only a loopback
    that is down), or None where this user may not make one."""
    for prefix in (["unshare", "-n"], ["unshare", "-r", "-n"]):
        try:
            if subprocess.run(prefix + ["true"], capture_output=True, timeout=30).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


OFFLINE = _network_cut()
needs_network_cut = pytest.mark.skipif(
    OFFLINE is None, reason="unshare -n (or unshare -r -n) is not allowed here: the network cannot be cut, and an "
                            "install that could reach an index would prove nothing about the wheelhouse")


def repack(name, folder):
    """A wheel of the installed pure-Python distribution ``name``, from the files pip installed
    (its RECORD): its own tags, a fresh RECORD; scripts are left out (pip writes them again from
    entry_points.txt), and so are pip's own notes (INSTALLER, REQUESTED, direct_url.json)."""
    import importlib.metadata

    dist = importlib.metadata.distribution(name)
    wheel = dist.read_text("WHEEL") or ""
    assert "Root-Is-Purelib: true" in wheel, f"{name}: not a pure-Python wheel"
    tags = [line.split(":", 1)[1].strip() for line in wheel.splitlines() if line.startswith("Tag:")]
    python = ".".join(dict.fromkeys(t.split("-")[0] for t in tags))
    abi, platform = tags[0].split("-")[1:]
    info = next(str(f).split("/")[0] for f in dist.files if str(f).split("/")[0].endswith(".dist-info"))
    skipped = (f"{info}/RECORD", f"{info}/INSTALLER", f"{info}/REQUESTED", f"{info}/direct_url.json")
    write_wheel(os.path.join(folder, f"{info[:-len('.dist-info')]}-{python}-{abi}-{platform}.whl"), info,
                {str(f): f.locate().read_bytes() for f in dist.files
                 if not (str(f).startswith("..") or "__pycache__" in str(f) or str(f).endswith(".pyc")
                         or str(f) in skipped)})
    return f"{dist.metadata['Name']}=={dist.version}"


def write_wheel(path, info, files):
    """The wheel ``path`` of ``files`` ({its name in the wheel: bytes}) and a RECORD of them, in
    the ``info`` folder (``NAME-VERSION.dist-info``), as pip checks one."""
    record = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for rel, data in files.items():
            whl.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{rel},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        whl.writestr(f"{info}/RECORD", "\n".join(record) + "\n")


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """A wheelhouse as scripts/wheelhouse.sh lays one out (the wheels, requirements.txt pinning
    each), for this machine's Python: this project built from a copy of the checkout, and SMALL."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    src = copy_clone(str(tmp_path_factory.mktemp("src")))
    proc = process_group.run([sys.executable, "-m", "pip", "--isolated", "wheel", "-q", "--disable-pip-version-check",
                              "--no-deps", "--no-build-isolation", "--no-index", "-w", str(folder), src],
                             env=dict(os.environ, PIP_CONFIG_FILE=os.devnull), capture_output=True, text=True,
                             timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    project = [w for w in os.listdir(folder) if w.startswith("vasso_plugins-")]
    assert len(project) == 1, os.listdir(folder)
    pins = [repack(name, str(folder)) for name in SMALL]
    pins.append("vasso-plugins==" + project[0].split("-")[1])
    (folder / "requirements.txt").write_text("\n".join(sorted(pins, key=str.lower)) + "\n")
    return folder


def _env(**extra):
    """This environment, less what would let the checkout's code or another index in."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    return dict(env, OMP_NUM_THREADS="1", **extra)


def run_test_gpu(*args, python, venv, timeout=300):
    """``unshare -n bash scripts/test_gpu.sh ARGS`` with PYTHON and VENV: the CompletedProcess."""
    return process_group.run(OFFLINE + ["bash", TEST_GPU, *map(str, args)],
                             env=_env(PYTHON=str(python), VENV=str(venv)), capture_output=True, text=True,
                             timeout=timeout)



#: One VASSO step in the environment the install made, from outside the checkout: where each
#: package came from, and the parameters after the step
ONE_STEP = r"""
import json, os, sys
import cloudpickle, parameterized, submitit, torch
import plugins
from plugins import VASSO

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = VASSO(model.parameters(), torch.optim.SGD, lr=0.1, rho=0.05)
x, y = torch.randn(8, 4), torch.randn(8, 2)

def closure():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss

opt.step(closure)
print(json.dumps({"where": {m.__name__: os.path.realpath(m.__file__)
                            for m in (plugins, submitit, cloudpickle, parameterized, torch)},
                  "steps": opt.num_steps, "params": [q.detach().tolist() for q in model.parameters()]}))
"""


def one_step_here():
    """The same step with this checkout's plugins (first on PYTHONPATH): what the installed copy must give."""
    here = process_group.run([sys.executable, "-c", ONE_STEP], env=_env(PYTHONPATH=REPO), cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert here.returncode == 0, here.stderr[-3000:]
    return json.loads(here.stdout.strip().splitlines()[-1])["params"]


@needs_network_cut
def test_the_offline_install_takes_every_package_from_the_wheelhouse_and_runs_a_vasso_step(wheelhouse, tmp_path):
    """The issue's walk first: the first try's Python has no torch (refused before anything is
    made), the second try's wheelhouse lacks a wheel (pip fails: the half-made venv is removed);
    the third, as the first's error advised, installs, and the environment runs a VASSO step."""
    import json

    venv = tmp_path / "venv-gpu"
    bare = tmp_path / "bare"  # a Python without torch: a venv of this Python's base, no site packages
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    first = run_test_gpu("--wheelhouse", wheelhouse, "--install-only", python=bare / "bin" / "python", venv=venv)
    assert first.returncode == 1 and "has none that imports" in first.stdout, first.stdout[-3000:] + first.stderr
    assert "PYTHON=/path/to/the/node's/python3" in first.stdout and not venv.exists()
    short = tmp_path / "short"  # a wheelhouse that lost a wheel
    shutil.copytree(wheelhouse, short)
    next(short.glob("parameterized-*.whl")).unlink()
    second = run_test_gpu("--wheelhouse", short, "--install-only", python=sys.executable, venv=venv)
    assert second.returncode == 1 and "the set-up did not finish" in second.stderr, second.stderr[-3000:]
    assert "parameterized" in second.stderr and not venv.exists()

    proc = run_test_gpu("--wheelhouse", wheelhouse, "--install-only", python=sys.executable, venv=venv)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "(no index, no network, no pip configuration)" in out
    assert "what this node lacks" not in out  # --install-only: no GPU, nvidia-smi, torchvision or DomainBed asked for
    pins = wheelhouse.joinpath("requirements.txt").read_text().split()
    listed = out.split("installed from the wheelhouse into")[1].split("[test_gpu")[0]
    assert f"({len(pins)} packages, each imported from there)" in listed, out[-3000:]
    assert sorted(listed.split()[-len(pins):]) == sorted(pins), out[-3000:]
    # pip put each into the venv's own site-packages, though this environment has them all too
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert site.startswith(str(venv))
    for pin in pins:
        name, version = pin.split("==")
        assert any(d.lower().startswith(f"{name.replace('-', '_').lower()}-{version}.dist-info")
                   for d in os.listdir(site)), (pin, sorted(os.listdir(site)))
    # the installed environment, from outside the checkout: this project and SMALL from the venv, torch
    # from the node's (this environment's), and one VASSO step as this checkout's code takes it
    step = process_group.run([str(venv / "bin" / "python"), "-c", ONE_STEP], env=_env(), cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)
    assert step.returncode == 0, step.stderr[-3000:]
    got = json.loads(step.stdout.strip().splitlines()[-1])
    real_venv = os.path.realpath(venv) + os.sep
    assert all(got["where"][m].startswith(real_venv) for m in ("plugins", "submitit", "cloudpickle", "parameterized"))
    here = sysconfig.get_paths()["purelib"]
    assert got["where"]["torch"].startswith(os.path.realpath(here) + os.sep), got["where"]["torch"]
    assert got["steps"] == 1 and got["params"] == one_step_here()
    # a second run finds the venv made from this wheelhouse over this Python and its torch
    again = run_test_gpu("--wheelhouse", wheelhouse, "--install-only", python=sys.executable, venv=venv)
    assert again.returncode == 0 and "installed from this wheelhouse over" in again.stdout, again.stdout[-3000:]


@needs_network_cut
def test_a_folder_the_script_did_not_make_is_never_replaced(wheelhouse, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's file")
    proc = run_test_gpu("--wheelhouse", wheelhouse, "--install-only", python=sys.executable, venv=mine)
    assert proc.returncode == 2 and "exists and is not a venv this script made" in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(mine)) == ["notes.txt"] and (mine / "notes.txt").read_text() == "a user's file"


def fake_wheel(folder, name, version):
    """A pure-Python wheel of ``name`` at ``version``: an empty module and its metadata, as pip reads one."""
    info = f"{name}-{version}.dist-info"
    write_wheel(os.path.join(folder, f"{name}-{version}-py3-none-any.whl"), info, {
        f"{name}.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"})
    return f"{name}=={version}"


@needs_network_cut
def test_a_wheelhouse_that_breaks_a_node_package_is_refused_naming_the_constraint(wheelhouse, tmp_path):
    """As on an H200 node whose transformers pins huggingface-hub below 2: the wheelhouse's copy of
    a package shadows the node's in the venv and breaks a node package that needs the node's (here
    sacrebleu, which needs tabulate>=0.8.9, against a wheelhouse's tabulate 0.0.1). The set-up stops,
    names the broken requirement and the constraint that makes a wheelhouse that keeps it, and
    leaves no venv behind."""
    import importlib.metadata

    sacrebleu = importlib.metadata.version("sacrebleu")
    assert any(r.replace(" ", "") == "tabulate>=0.8.9" for r in importlib.metadata.requires("sacrebleu"))
    shadowing = tmp_path / "shadowing"
    shutil.copytree(wheelhouse, shadowing)
    pins = (shadowing / "requirements.txt").read_text().split() + [fake_wheel(shadowing, "tabulate", "0.0.1")]
    (shadowing / "requirements.txt").write_text("\n".join(sorted(pins, key=str.lower)) + "\n")
    venv = tmp_path / "venv-gpu"
    proc = run_test_gpu("--wheelhouse", shadowing, "--install-only", python=sys.executable, venv=venv)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = proc.stderr
    assert "the wheelhouse's packages break packages of the node" in said, said[-3000:]
    assert f"sacrebleu {sacrebleu} has requirement tabulate>=0.8.9, but you have tabulate 0.0.1." in said, said[-3000:]
    fix = said.split("--constraint FILE")[1]
    assert [line.strip() for line in fix.splitlines()[1:] if line.strip()][:1] == ["tabulate>=0.8.9"], said[-3000:]
    assert "the set-up did not finish" in said and not venv.exists()
    assert "installed from the wheelhouse into" not in proc.stdout
