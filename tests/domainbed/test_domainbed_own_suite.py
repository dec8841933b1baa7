"""DomainBed's own test suite after register(), with SAM, GSAM and VASSO among the
algorithms it loops over, run in its own pytest process on a copy of DomainBed (its
collect_results test writes into its tree)."""

import json
import os
import shutil
import warnings
import xml.etree.ElementTree as ET

import process_group
import pytest
from domainbed_testlib import DOMAINBED, PY, ROOT, SKIP_REASON

pytestmark = pytest.mark.skipif(DOMAINBED is None, reason=SKIP_REASON)

HERE = os.path.dirname(os.path.abspath(__file__))  # register_plugin.py
OURS = ("SAM", "GSAM", "VASSO")


def run_suite(copy, report, node_ids=(), register=True):
    env = {k: v for k, v in os.environ.items() if k not in ("DATA_DIR", "PYTHONPATH")}
    env.update(
        # DomainBed's tests run `python -m domainbed.scripts...` from its root
        PATH=os.path.dirname(PY) + os.pathsep + env.get("PATH", ""),
        PYTHONPATH=os.pathsep.join([HERE, ROOT, str(copy)]), DOMAINBED_ROOT=str(copy),
        PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1", DOMAINBED_VASSO_NUM_WORKERS="0",
        # ResNets without the ImageNet download; no Debug224 (a ResNet-50 per algorithm, minutes
        # on a CPU: 86 s for VASSO's alone on 2 idle cores): every algorithm runs on Debug28, and
        # VASSO's step on a ResNet-50 is test_domainbed_end_to_end.py's
        # test_one_vasso_step_on_debug224_resnet50_without_weights, through DomainBed's train.py
        DOMAINBED_VASSO_RESNET_WEIGHTS="none", VASSO_SUITE_DEBUG224="0",
        VASSO_SUITE_REGISTER="1" if register else "0")
    # no DATA_DIR: DomainBed skips the tests that need downloaded data sets, as anywhere without them
    targets = list(node_ids) or [str(copy / "domainbed" / "test")]
    return process_group.run(
        [PY, "-m", "pytest", "-p", "register_plugin", "-p", "no:cacheprovider", "-q", "-rfEs",
         "--rootdir", str(copy), "-c", str(copy / "pytest.ini"), f"--junitxml={report}", *targets],
        cwd=copy, env=env, capture_output=True, text=True, timeout=1500)


def outcomes(report):
    """``{node id: "passed" | "failed" | "skipped"}`` from a junit report."""
    out = {}
    for case in ET.parse(report).iter("testcase"):
        path = case.get("classname").replace(".", "/")  # domainbed.test.test_models.TestAlgorithms
        module, cls = path.rsplit("/", 1)
        node = f"{module}.py::{cls}::{case.get('name')}"
        kinds = {child.tag for child in case}
        out[node] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return out


def test_domainbeds_own_suite_passes_after_register(tmp_path):
    copy = tmp_path / "DomainBed"
    shutil.copytree(DOMAINBED, copy, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    for d, _, _ in os.walk(copy):
        os.chmod(d, 0o755)
    (copy / "pytest.ini").write_text("[pytest]\n")  # DomainBed's suite, not this project's config

    proc = run_suite(copy, tmp_path / "with.xml")
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = outcomes(tmp_path / "with.xml")
    passed = [n for n, o in result.items() if o == "passed"]
    failed = sorted(n for n, o in result.items() if o == "failed")
    assert len(passed) > 700, proc.stdout[-3000:]

    # DomainBed's per-algorithm tests saw ours: its hparams test for every (algorithm, dataset)
    # and init/update/predict on Debug28 for every algorithm (Debug224's deselected: its one
    # case per algorithm is a ResNet-50, which test_domainbed_end_to_end.py steps for VASSO)
    check = process_group.run([PY, "-c", "import json, domainbed_vasso; domainbed_vasso.register(); "
                               "from domainbed import algorithms; print(json.dumps(algorithms.ALGORITHMS))"],
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, str(copy)])),
                              capture_output=True, text=True, timeout=300, check=True)
    algorithms = json.loads(check.stdout.splitlines()[-1])
    assert algorithms[-3:] == list(OURS)
    init_update = [n for n in result if "test_init_update_predict" in n]
    assert len(init_update) == len(algorithms) and not any(n.endswith("_Debug224") for n in init_update)
    names = [f"test_init_update_predict_{i:02d}_Debug28" for i in range(len(algorithms) - 3, len(algorithms))]
    for name in names:
        node = f"domainbed/test/test_models.py::TestAlgorithms::{name}"
        assert result.get(node) == "passed", (node, proc.stdout[-3000:])

    # Whatever fails must fail the same way without register(): DomainBed in this
    # environment (e.g. Fishr, whose backpack-for-pytorch does not work with torch >= 2.x
    # here), not the plugin. The same cases are run again, unregistered.
    if failed:
        run_suite(copy, tmp_path / "without.xml", failed, register=False)
        stock_result = outcomes(tmp_path / "without.xml")
        caused = [n for n in failed if stock_result.get(n) != "failed"]
        assert not caused, (caused, proc.stdout[-4000:])
        warnings.warn(f"DomainBed's own tests that fail here without register() too: {failed}")
