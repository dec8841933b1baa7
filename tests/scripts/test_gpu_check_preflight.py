"""scripts/test_gpu.sh says what the node lacks before any work, each with its one-line fix, on a
CPU made to look like a GPU node in the ways that matter here: an nvidia-smi on PATH that lists
a GPU (a stand-in: a script), torchvision that fails to import (a stand-in package first on
PYTHONPATH raising what a torchvision built for another torch raises) and a DOMAINBED_ROOT that
holds no DomainBed. torch sees no GPU here (CUDA_VISIBLE_DEVICES empty, on a GPU machine too), so
the check stops: nothing run, nothing installed."""

import os
import sys

import process_group
from checkout import REPO

TEST_GPU = os.path.join(REPO, "scripts", "test_gpu.sh")


def test_what_the_node_lacks_is_listed_with_its_fixes_before_any_work(tmp_path):
    bin_dir, hide = tmp_path / "bin", tmp_path / "hide" / "torchvision"
    bin_dir.mkdir()
    hide.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    (hide / "__init__.py").write_text('raise ImportError("operator torchvision::nms does not exist")\n')
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(hide.parent),
               DOMAINBED_ROOT=str(tmp_path / "no-domainbed"), TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    proc = process_group.run(["bash", TEST_GPU, "--python", sys.executable], env=env, capture_output=True, text=True,
                             timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lacks = proc.stdout.split("what this node lacks, each with its fix:\n")[1].splitlines()
    assert [line.split(":")[0] for line in lacks] == ["  - a GPU that torch sees", "  - torchvision (ImportError",
                                                     "  - DomainBed (DomainBedNotFound"], lacks
    assert all("; fix: " in line for line in lacks)
    assert "nvidia-smi lists 1" in lacks[0] and "CUDA_VISIBLE_DEVICES" in lacks[0]
    assert "part 4 benchmarks the transformer alone" in lacks[1]
    assert "export DOMAINBED_ROOT=/path/to/DomainBed" in lacks[2]
    assert proc.stderr.strip() == "test_gpu.sh: nothing was run or installed: the node lacks what the check needs (above)"
    assert sorted(os.listdir(tmp_path)) == ["bin", "hide"]  # no run folder made


def test_without_nvidia_smi_the_gpus_are_counted_by_torch(tmp_path):
    """No nvidia-smi on PATH (a container that shows the GPU to torch alone): a note with its fix,
    and torch's count decides (none here: the check stops, saying there is no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "sha256sum", "cut", "grep", "sed", "awk", "mktemp", "dirname", "cat", "ls", "wc"):
        for folder in os.environ["PATH"].split(os.pathsep):
            if os.path.isfile(os.path.join(folder, tool)):
                (bin_dir / tool).symlink_to(os.path.join(folder, tool))
                break
    env = dict(os.environ, PATH=str(bin_dir), TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    proc = process_group.run([str(bin_dir / "bash"), TEST_GPU, "--python", sys.executable], env=env,
                             capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "  - nvidia-smi: not on PATH" in proc.stdout and "the GPUs are counted by torch" in proc.stdout
    assert "  - an NVIDIA GPU: no NVIDIA GPU found (nvidia-smi -L is not there, torch sees none)" in proc.stdout
