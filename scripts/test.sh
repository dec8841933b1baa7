#!/usr/bin/env bash
# The project's test command: set up the environment, then run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -ra tests/core -x`).
# DomainBed tests need a DomainBed checkout: DOMAINBED_ROOT, else ../shared/DomainBed
# beside the repository (as CI has it), else one installed by
# `bash scripts/setup_env.sh --with-domainbed`; without any, they skip and say so.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if [ -z "${DOMAINBED_ROOT:-}" ] && [ -f ../shared/DomainBed/domainbed/__init__.py ]; then
    DOMAINBED_ROOT=$(cd ../shared/DomainBed && pwd)
    export DOMAINBED_ROOT
    echo "DomainBed tests use DOMAINBED_ROOT=$DOMAINBED_ROOT"
fi
# One worker more than the cores, as CI runs it (pytest-xdist, each file on one worker:
# tests/conftest.py orders the files and names each as it starts and ends): many files wait
# on the processes they start (Slurm's jobs, torchrun's ranks, the docs' commands), and the
# extra worker fills those waits; at most 8 workers (each holds torch and fairseq, and many
# tests start processes of their own); not where the arguments choose the workers (-n,
# -p no:xdist) or need one process (--pdb, --trace).
workers=()
# the cores this process may use (nproc would count OMP_NUM_THREADS, set below, instead)
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
if [ "$cores" -gt 1 ] && ! printf '%s\n' "$@" | grep -qE '^(-n|--numprocesses|--dist|--pdb|--trace|no:xdist$|-pno:xdist$)'; then
    workers=(-n "$((cores < 7 ? cores + 1 : 8))" --dist loadfile)
fi
# The tests use tiny models, often in several processes at once: one thread each
# avoids OpenMP spinning against the other processes on small machines.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${VENV:-.venv}/bin/python" -m pytest ${workers[@]+"${workers[@]}"} "$@"
