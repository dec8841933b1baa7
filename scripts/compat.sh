#!/usr/bin/env bash
# Proves the torch floor declared in setup.cfg (or the version given) in a throwaway venv:
#   bash scripts/compat.sh            -> the floor (`torch>=X` in setup.cfg)
#   bash scripts/compat.sh 2.4.1      -> another torch
# torch, the matching torchvision and numpy<2 come in ONE pip command, so nothing pulls
# torch back up; the package and its domainbed + test extras are then installed under a
# constraints file that pins them. It runs the core tests, the plugins doctests and the
# DomainBed algorithm tests (DomainBed from DOMAINBED_ROOT, else ../shared/DomainBed, else
# the copy of setup_env.sh --with-domainbed in .venv/src/DomainBed);
# fairseq keeps its pinned build in the main environment and is not part of this check.
# COMPAT_VENV=path picks the venv (default: a fresh one under $TMPDIR, removed at the end;
# KEEP_COMPAT_VENV=1 keeps it). PYTHON=python3.x picks the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$SECONDS
say() { echo "[compat $((SECONDS - START)) s] $*"; }

FLOOR=$(sed -n 's/^ *torch>=\([0-9.]*\).*/\1/p' setup.cfg | head -1)
TORCH=${1:-$FLOOR}
[ -n "$TORCH" ] || { echo "compat.sh: no torch version given and no 'torch>=X' in setup.cfg" >&2; exit 2; }
case "$TORCH" in  # torchvision built against each torch (pytorch/vision's compatibility table)
    1.13.1) VISION=0.14.1 ;; 2.0.1) VISION=0.15.2 ;; 2.1.2) VISION=0.16.2 ;; 2.2.2) VISION=0.17.2 ;;
    2.3.1) VISION=0.18.1 ;; 2.4.1) VISION=0.19.1 ;; 2.5.1) VISION=0.20.1 ;; 2.6.0) VISION=0.21.0 ;;
    2.14.1) VISION=0.29.1 ;;
    *) echo "compat.sh: no known torchvision for torch $TORCH: add it to the table in scripts/compat.sh" >&2; exit 2 ;;
esac

if [ -z "${DOMAINBED_ROOT:-}" ]; then  # as scripts/test.sh, then the copy of setup_env.sh --with-domainbed
    for candidate in ../shared/DomainBed .venv/src/DomainBed; do
        if [ -d "$candidate/domainbed" ]; then DOMAINBED_ROOT=$(cd "$candidate" && pwd); break; fi
    done
fi
[ -n "${DOMAINBED_ROOT:-}" ] && [ -d "$DOMAINBED_ROOT/domainbed" ] || {  # the tests' one message
    echo "compat.sh: the DomainBed algorithm tests need DomainBed." \
         "$("${PYTHON:-python3}" -c 'from domainbed_vasso._locate import NOT_IMPORTABLE; print(NOT_IMPORTABLE)')" >&2
    exit 2; }
export DOMAINBED_ROOT

if [ -n "${COMPAT_VENV:-}" ]; then
    VENV=$COMPAT_VENV
else
    VENV=$(mktemp -d "${TMPDIR:-/tmp}/vasso-compat-torch$TORCH.XXXXXX")
    [ "${KEEP_COMPAT_VENV:-0}" = 1 ] || trap 'rm -rf "$VENV"' EXIT
fi
py="$VENV/bin/python"
[ -x "$py" ] || "${PYTHON:-python3}" -m venv "$VENV"
pipq() {  # pip -q, minus the "Location ... is ignored" lines some pip configurations print
    "$py" -m pip install -q --disable-pip-version-check --progress-bar off "$@" \
        2> >(grep -v "^WARNING: Location '.*' is ignored" >&2)
}

say "installing torch $TORCH, torchvision $VISION, numpy<2 into $VENV (the registry's CUDA builds: a few minutes)"
pipq "torch==$TORCH" "torchvision==$VISION" "numpy<2"
constraints="$VENV/constraints.txt"
printf 'torch==%s\ntorchvision==%s\nnumpy<2\n' "$TORCH" "$VISION" > "$constraints"
# The package itself without its dependency on torch (a candidate below the declared floor
# must install too), then every other requirement of it and its two extras, torch pinned.
requirements="$VENV/requirements.txt"
"$py" - "$ROOT/setup.cfg" > "$requirements" <<'PY'
import configparser, re, sys
cfg = configparser.ConfigParser()
cfg.read(sys.argv[1])
lines = cfg["options"]["install_requires"].splitlines()
for extra in ("domainbed", "test"):
    lines += cfg["options.extras_require"][extra].splitlines()
for line in lines:
    line = line.split("#")[0].strip()
    if line and re.split(r"[<>=!~\[ ;]", line)[0].lower() not in ("torch", "torchvision"):
        print(line)
PY
say "installing vasso-plugins (no deps) and its domainbed + test requirements, torch pinned: $(tr '\n' ' ' < "$requirements")"
pipq --no-deps -e "$ROOT"
pipq -c "$constraints" -r "$requirements"

got=$("$py" -c "import torch; print(torch.__version__)")
case "$got" in
    "$TORCH"|"$TORCH"+*) say "torch $got in the venv" ;;
    *) echo "compat.sh: expected torch $TORCH in $VENV, found $got" >&2; exit 1 ;;
esac

say "running tests/core, the plugins doctests and the DomainBed algorithm tests"
OMP_NUM_THREADS=1 PYTHONPATH="$ROOT" "$py" -m pytest -q -ra -p no:cacheprovider \
    tests/core plugins tests/domainbed/test_domainbed_algorithms.py
say "torch $TORCH: passed"
