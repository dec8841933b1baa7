#!/usr/bin/env bash
# The project's test command: set up the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core -x`).
# DomainBed tests run when DOMAINBED_ROOT points at a DomainBed checkout, and skip otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The tests use tiny models, often in several processes at once: one thread each
# avoids OpenMP spinning against the other processes on small machines.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
