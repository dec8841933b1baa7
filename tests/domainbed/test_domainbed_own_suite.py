"""DomainBed's own test suite still passes after register() (with SAM, GSAM and VASSO
among the algorithms it loops over), run in its own pytest process."""

import json
import os
import subprocess

import pytest
from domainbed_testlib import DOMAINBED, PY, SKIP_REASON, env

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)

HERE = os.path.dirname(os.path.abspath(__file__))  # register_plugin.py


def test_domainbeds_own_suite_passes_after_register(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this project's config
    suite = os.path.join(DOMAINBED, "domainbed", "test")
    base = env()
    proc = subprocess.run(
        [PY, "-m", "pytest", "-p", "register_plugin", "-p", "no:cacheprovider", "-v", "-rs",
         "--rootdir", str(tmp_path), "-c", str(tmp_path / "pytest.ini"), suite],
        cwd=tmp_path, capture_output=True, text=True, timeout=1500,
        # no DATA_DIR: DomainBed skips its tests that need downloaded data sets, as it does
        # anywhere without them; the others use its Debug datasets. ResNets: no ImageNet download.
        env=env(PYTHONPATH=HERE + os.pathsep + base["PYTHONPATH"], PYTHONDONTWRITEBYTECODE="1",
                DOMAINBED_VASSO_RESNET_WEIGHTS="none"))
    tail = proc.stdout[-5000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if " FAILED" in line or " ERROR" in line], tail
    # every algorithm, ours included, through DomainBed's init/update/predict test, per Debug dataset
    algorithms = json.loads(subprocess.run(
        [PY, "-c", "import json, domainbed_vasso; domainbed_vasso.register(); "
                   "from domainbed import algorithms; print(json.dumps(algorithms.ALGORITHMS))"],
        env=base, capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()[-1])
    assert {"SAM", "GSAM", "VASSO"} <= set(algorithms)
    passed = [line for line in lines if "test_init_update_predict" in line and " PASSED" in line]
    assert len(passed) == 2 * len(algorithms), tail
