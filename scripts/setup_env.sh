#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment, idempotently.
#   bash scripts/setup_env.sh                    -> .venv with torch, torchvision, fairseq, fairscale, this package
#   bash scripts/setup_env.sh --with-domainbed   -> the same, plus DomainBed at the tested commit,
#                                                   importable in .venv (scripts/install_domainbed.sh)
#   bash scripts/setup_env.sh --with-domainbed=/path/to/DomainBed[@COMMIT]   (a checkout or tarball)
#   bash scripts/setup_env.sh --stamp            -> prints the stamp a ready venv holds, and nothing else
# VENV=path picks another location, PYTHON=python3.x another interpreter.
# The order matters: fairseq-fixed compiles against the torch it finds, so torch comes
# first and fairseq is built without build isolation.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_DOMAINBED=0
PRINT_STAMP=0
DOMAINBED_SOURCE=""
for arg in "$@"; do
    case "$arg" in
        --with-domainbed) WITH_DOMAINBED=1 ;;
        --with-domainbed=*) WITH_DOMAINBED=1; DOMAINBED_SOURCE=${arg#--with-domainbed=} ;;
        --stamp) PRINT_STAMP=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "setup_env.sh: unknown argument $arg (expected --with-domainbed[=/path/to/DomainBed[@COMMIT]] or --stamp)" >&2; exit 2 ;;
    esac
done
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
START=$SECONDS
stage() { echo "[setup $((SECONDS - START)) s] $*"; }

# the install recipe of this checkout, where it is
stamp=$( (cat setup.cfg pyproject.toml scripts/setup_env.sh; pwd) | sha256sum | cut -c1-16)
[ "$PRINT_STAMP" = 0 ] || { echo "$stamp"; exit 0; }
[ -x "$VENV/bin/python" ] || { stage "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
py="$VENV/bin/python"
# pip -q, minus the "Location ... is ignored" lines some pip configurations print per package
pipq() {
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}
has() { "$py" -c "import $1" >/dev/null 2>&1; }
# with_progress WHAT COMMAND...: runs COMMAND, with a line every 30 s while it runs (a compile
# prints nothing for minutes); its exit status is COMMAND's
with_progress() {
    local what=$1 began=$SECONDS next=$((SECONDS + 30)) pid; shift
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if (( SECONDS >= next )) && kill -0 "$pid" 2>/dev/null; then
            stage "$what: $((SECONDS - began)) s so far"
            next=$((next + 30))
        fi
    done
    wait "$pid"
}
# "torch X | fairseq Y | python Z" where all three import (one interpreter: each import of
# torch costs seconds, and scripts/test.sh runs this script before every test command)
versions() {
    "$py" -W ignore::FutureWarning -c "import sys, torch, fairseq, plugins; print('torch', torch.__version__, \
'| fairseq', fairseq.__version__, '| python', sys.version.split()[0])"
}

# Nothing to do when this checkout's install recipe has not changed since the last full run.
stamp_file="$VENV/.vasso-setup-stamp"
ready=""
if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && ready=$(versions 2>/dev/null); then
    stage "packages up to date (setup.cfg unchanged since the last setup)"
else
    if has torch && has torchvision; then
        stage "torch and torchvision present"
    else
        stage "installing torch 2.14.1 and torchvision 0.29.1 (a large download the first time)"
        pipq torch==2.14.1 torchvision==0.29.1
    fi
    stage "installing build tools (setuptools, wheel, cython, numpy)"
    pipq setuptools wheel cython numpy
    if has fairseq; then
        stage "fairseq present"
    else
        # Side by side, one extension more than the cores (setuptools' build_ext --parallel,
        # through a config file of this build only), each compiled by distutils: torch's
        # BuildExtension would use ninja where it finds one, from one build.ninja in the shared
        # build folder, which two extensions overwrite (one was linked from an object never
        # built). A stand-in `ninja` that fails, first on PATH for this build only, makes torch
        # fall back to distutils. fairseq lists its three torch extensions (35 to 70 s and up to
        # 2 GB each) last: one per core left the last of them compiling alone for a minute, one
        # more keeps the cores busy. Measured on 2 idle cores (pip wheel of the sdist): 179 s
        # with 2 at once, 160 s with 3; one at a time through ninja took 350 s.
        build_dir=$(mktemp -d "${TMPDIR:-/tmp}/vasso-build.XXXXXX")
        trap 'rm -rf "$build_dir"' EXIT
        cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1)
        printf '[build_ext]\nparallel = %d\n' "$((cores < 8 ? cores + 1 : 8))" > "$build_dir/build_ext.cfg"
        printf '#!/bin/sh\nexit 1\n' > "$build_dir/ninja" && chmod +x "$build_dir/ninja"
        stage "building fairseq-fixed 0.12.3.1 against this torch (3 minutes on 2 idle cores, 6 on busy ones)"
        PATH="$build_dir:$PATH" DIST_EXTRA_CONFIG="$build_dir/build_ext.cfg" \
            with_progress "building fairseq-fixed" pipq --no-build-isolation --no-cache-dir fairseq-fixed==0.12.3.1
    fi
    stage "installing this package with its fairseq, domainbed, test, slurm and sharding extras"
    pipq --no-build-isolation -e ".[fairseq,domainbed,test,slurm,sharding]"
    echo "$stamp" > "$stamp_file"
fi
# fairseq's own tests (tests/fairseq/test_fairseq_own_suite.py runs them stock beside
# plugin-loaded): the tests/ of fairseq-fixed 0.12.3.1's sdist, fetched at a pinned sha256
if [ ! -f "$VENV/fairseq-fixed-0.12.3.1-tests/test_train.py" ]; then
    stage "unpacking fairseq-fixed 0.12.3.1's own tests (its sdist's tests/) into $VENV/fairseq-fixed-0.12.3.1-tests"
    bash scripts/fairseq_tests.sh "$VENV"
fi
if [ "$WITH_DOMAINBED" = 1 ]; then
    stage "installing DomainBed"
    VENV=$VENV bash scripts/install_domainbed.sh ${DOMAINBED_SOURCE:+"$DOMAINBED_SOURCE"}
fi
[ -n "$ready" ] || ready=$(versions)  # after an install: its errors shown, and set -e stops here
stage "environment ready: $ready"
