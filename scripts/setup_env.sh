#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment, idempotently.
#   bash scripts/setup_env.sh            -> .venv with torch, torchvision, fairseq, this package
# VENV=path picks another location, PYTHON=python3.x another interpreter.
# The order matters: fairseq-fixed compiles against the torch it finds, so torch comes
# first and fairseq is built without build isolation.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
py="$VENV/bin/python"
pipq() { "$py" -m pip install -q --disable-pip-version-check "$@"; }
has() { "$py" -c "import $1" >/dev/null 2>&1; }

has torch && has torchvision || pipq torch==2.14.1 torchvision==0.29.1
pipq setuptools wheel cython numpy
# about 3 minutes of compiling the first time
has fairseq || pipq --no-build-isolation --no-cache-dir fairseq-fixed==0.12.3.1
pipq --no-build-isolation -e ".[fairseq,domainbed,test,slurm]"
"$py" -c "import torch, fairseq, plugins; print('environment ready: torch', torch.__version__, '| fairseq', fairseq.__version__, '| python', __import__('sys').version.split()[0])"
