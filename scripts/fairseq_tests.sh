#!/usr/bin/env bash
# fairseq's own tests for tests/fairseq/test_fairseq_own_suite.py, which runs them stock beside
# plugin-loaded: the tests/ folder of fairseq-fixed 0.12.3.1's sdist, unpacked into
# VENV/fairseq-fixed-0.12.3.1-tests.  Called by scripts/setup_env.sh; idempotent.
#   bash scripts/fairseq_tests.sh VENV
# The sdist is fetched from PyPI at a pinned URL and checked against PyPI's sha256 (no build:
# `pip download --no-binary` would prepare fairseq's metadata).  Its 51 test_*.py files are
# those of github.com/JackismyShephard/fairseq at 9fac383 with CRLF line ends; they are
# unpacked as they are.  fairseq's tests/utils.py is not in the sdist, nor
# in any other package on PyPI (docs/fairseq.md, "Tests"); tests/__init__.py is empty at
# 9fac383, and the test creates it.
# Offline, it prints one line and returns 0: the test then skips, saying why (and fails
# where VASSO_REQUIRE_FAIRSEQ_TESTS=1, as in CI).
set -euo pipefail
[ $# = 1 ] || { echo "usage: bash scripts/fairseq_tests.sh VENV" >&2; exit 2; }
dest="$1/fairseq-fixed-0.12.3.1-tests"
[ -f "$dest/test_train.py" ] && exit 0
py="$1/bin/python"
[ -x "$py" ] || py=python3
url=https://files.pythonhosted.org/packages/7e/e9/df8fe7f34cfb7dbaacdb7a288813cad22491a32ea278820268ee34ac57ec/fairseq_fixed-0.12.3.1.tar.gz
sha256=c607577a54ab30e2ee0f0b0a754ea5cdbc6ad0a9f99a1726638a2201445bc1cc
work=$(mktemp -d "${TMPDIR:-/tmp}/fairseq-sdist.XXXXXX")
trap 'rm -rf "$work"' EXIT
# offline or a changed file: the one line it prints says why, and setup goes on
"$py" - "$url" "$sha256" "$work" "$dest" <<'EOF' || true
import hashlib, os, shutil, sys, tarfile, urllib.request

url, sha256, work, dest = sys.argv[1:]
archive, partial = os.path.join(work, "sdist.tar.gz"), dest + ".partial"
prefix = "fairseq_fixed-0.12.3.1/tests/"
try:
    with urllib.request.urlopen(url, timeout=120) as response, open(archive, "wb") as out:
        shutil.copyfileobj(response, out)
    with open(archive, "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    if got != sha256:
        raise ValueError(f"the sdist has sha256 {got}, expected {sha256}")
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(work, members=members, **safe)
    for old in (partial, dest):
        shutil.rmtree(old, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    shutil.move(os.path.join(work, prefix), partial)
    os.replace(partial, dest)
except Exception as exc:  # offline, a changed file, a full disk: setup goes on without them
    sys.exit(f"fairseq_tests.sh: no fairseq-fixed 0.12.3.1 sdist ({exc}): fairseq's own tests will skip")
EOF
