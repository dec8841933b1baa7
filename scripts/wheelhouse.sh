#!/usr/bin/env bash
# A folder of wheels for a GPU node without network (scripts/test_gpu.sh --wheelhouse DIR), built
# on a machine with network:
#   bash scripts/wheelhouse.sh DIR --python-version 3.12 --platform manylinux_2_28_x86_64 [--torch 2.11.0] [--constraint FILE]
# DIR holds this project as a wheel and every package its extras (setup.cfg: fairseq, domainbed,
# test, slurm, sharding) need, pinned in DIR/requirements.txt, for that Python and platform,
# WITHOUT the torch stack (torch, torchvision, torchaudio, triton, nvidia-*, cuda-*): the node
# brings its own, built for its CUDA. --torch names the node's torch version, which the
# resolution is made against (default: the newest torch that pip allows).
# pip resolves the set (pip install --dry-run --report: metadata only, torch is not downloaded);
# packages that PyPI has as source only (fairscale, antlr4-python3-runtime, littleutils, ...)
# are built into wheels with `pip wheel --no-deps`: pure Python ones for any target; one with
# compiled code (fairseq-fixed where PyPI has no wheel for the target, e.g. cp311) only when the
# Python that runs this script (PYTHON, default python3) is the target's version, with torch,
# numpy and cython installed (fairseq compiles against them: give it the node's torch version).
# Before any work it asks the index whether fairseq-fixed must be compiled here, and if so refuses
# a PYTHON of another version, or without the node's torch (--torch), numpy or cython, naming the
# fix; while it compiles it says every 30 s how long it has taken (and the build log's last line).
# --find-links FOLDER (repeatable): wheels built already (e.g. fairseq-fixed by the node's Python).
# --constraint FILE (repeatable): pip constraints the resolution keeps, such as the versions a
# node's own packages need (scripts/test_gpu.sh names them when the wheelhouse's copies break those).
# The node's platform: `python3 -c 'import sysconfig; print(sysconfig.get_platform())'` on the node
# gives e.g. linux-x86_64, and `ldd --version | head -1` its glibc, e.g. 2.28: manylinux_2_28_x86_64.
# DIR must be new or empty. Run `bash scripts/wheelhouse.sh --help` for this text.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }  # the comment above
DIR="" PYVER="" PLATFORM="" TORCH="" LINKS=() CONSTRAINTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --constraint) [ -f "${2:-}" ] || { echo "wheelhouse.sh: --constraint needs a file of pip constraints, got '${2:-}'" >&2; exit 2; }
                      CONSTRAINTS+=(--constraint "$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift 2 ;;
        --find-links) [ -d "${2:-}" ] || { echo "wheelhouse.sh: --find-links needs a folder of wheels" >&2; exit 2; }
                      LINKS+=(--find-links "$(cd "$2" && pwd)"); shift 2 ;;
        --python-version) PYVER=${2:?--python-version needs a value, e.g. 3.12}; shift 2 ;;
        --platform) PLATFORM=${2:?--platform needs a value, e.g. manylinux_2_28_x86_64}; shift 2 ;;
        --torch) TORCH=${2:?--torch needs a version, e.g. 2.11.0}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "wheelhouse.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) [ -z "$DIR" ] || { echo "wheelhouse.sh: one folder only (got $DIR and $1)" >&2; exit 2; }; DIR=$1; shift ;;
    esac
done
[ -n "$DIR" ] || { echo "wheelhouse.sh: name the folder to fill (see --help)" >&2; exit 2; }
[[ "$PYVER" =~ ^3\.[0-9]+$ ]] || { echo "wheelhouse.sh: --python-version must be like 3.12 (the node's Python), got '${PYVER}'" >&2; exit 2; }
[ -n "$PLATFORM" ] || { echo "wheelhouse.sh: --platform is required, e.g. manylinux_2_28_x86_64 (on the node: python3 -c 'import sysconfig; print(sysconfig.get_platform())' for the machine, ldd --version for the glibc)" >&2; exit 2; }
if [ -e "$DIR" ] && [ -n "$(ls -A "$DIR")" ]; then
    echo "wheelhouse.sh: $DIR exists and is not empty: give a new or empty folder" >&2; exit 2
fi
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "wheelhouse.sh: no $PY: PYTHON=/path/to/python3 names the builder" >&2; exit 2; }
"$PY" -c "import pip" 2>/dev/null || { echo "wheelhouse.sh: $PY has no pip: PYTHON=/path/to/python3 names a builder that has" >&2; exit 2; }
pip_() { "$PY" -m pip --disable-pip-version-check "$@"; }
here_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cpver=cp${PYVER/./}
# pip takes --platform literally: a manylinux_2_N node also runs manylinux_2_M wheels for M < N
platforms=(--platform "$PLATFORM")
if [[ "$PLATFORM" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    for ((m = BASH_REMATCH[1] - 1; m >= 5; m--)); do platforms+=(--platform "manylinux_2_${m}_${BASH_REMATCH[2]}"); done
    for legacy in manylinux2014 manylinux2010 manylinux1; do platforms+=(--platform "${legacy}_${BASH_REMATCH[2]}"); done
    platforms+=(--platform "linux_${BASH_REMATCH[2]}")  # what `pip wheel` tags a wheel it compiled here
fi
target=(--python-version "$PYVER" "${platforms[@]}" --implementation cp --abi "$cpver" --abi abi3 --abi none)
EXTRAS=$("$PY" - <<'PY'
import configparser
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
print(",".join(k for k in cfg["options.extras_require"] if k != "plot"))
PY
)
TORCH_STACK='^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-.*|cuda-.*)$'
FAIRSEQ=$(sed -n 's/^[[:space:]]*\(fairseq-fixed==[^[:space:]#;]*\).*/\1/p' setup.cfg | head -1)
work=$(mktemp -d "${TMPDIR:-/tmp}/wheelhouse.XXXXXX")
building=""  # a build's pid while it runs: ended with this script
trap '[ -z "$building" ] || kill "$building" 2>/dev/null; rm -rf "$work"' EXIT
start=$SECONDS
say() { echo "[wheelhouse $((SECONDS - start)) s] $*"; }

# ---------------------------------------------------------------- before any work: the fairseq build
# fairseq-fixed compiles against torch: a wheel of it built with another torch than the node's does
# not load there, and an isolated build would fetch the newest torch. Asked of the index (metadata
# only): is there a wheel for the target, or in --find-links?
say "is there a wheel of $FAIRSEQ for Python $PYVER on $PLATFORM? (else it is compiled here)"
if pip_ install -vv --dry-run --no-deps --ignore-installed --target "$work/probe" --only-binary :all: \
        "${target[@]}" "${LINKS[@]}" "$FAIRSEQ" >"$work/probe.log" 2>&1; then
    compile_fairseq=0
elif grep -q "No matching distribution found" "$work/probe.log" \
        && ! grep -qE "^Could not fetch URL|Retrying" "$work/probe.log"; then  # (-vv: pip's network errors)
    compile_fairseq=1
else
    echo "wheelhouse.sh: could not ask the index about $FAIRSEQ (is there network?):" >&2
    grep -E "^Could not fetch URL|^ERROR" "$work/probe.log" | tail -3 >&2
    exit 1
fi
if [ "$compile_fairseq" = 1 ]; then
    fix="PYTHON=/path/to/python$PYVER with the node's torch${TORCH:+ ($TORCH)}, numpy and cython, or --find-links FOLDER holding a $FAIRSEQ wheel built on the node"
    [ "$here_version" = "$PYVER" ] || {
        echo "wheelhouse.sh: $FAIRSEQ has no wheel for Python $PYVER on $PLATFORM and must be compiled here, by a" \
             "Python $PYVER; $PY is $here_version: $fix" >&2; exit 2; }
    builder=$("$PY" - "${TORCH}" <<'PY' 2>&1
import importlib.util, sys
missing = [m for m in ("torch", "numpy", "Cython") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"it lacks {', '.join(missing)}")
import torch
if sys.argv[1] and torch.__version__.split("+")[0] != sys.argv[1]:
    sys.exit(f"its torch is {torch.__version__}, the node's (--torch) {sys.argv[1]}: fairseq compiled against one "
             "does not load with the other")
print(torch.__version__)
PY
) || { echo "wheelhouse.sh: $FAIRSEQ must be compiled here, against the node's torch, and $PY cannot: $builder;" \
            "$fix" >&2; exit 2; }
    say "$FAIRSEQ will be compiled here by $PY (Python $here_version, torch $builder)$([ -n "$TORCH" ] || echo \
        "; give --torch, the node's torch version, to check it is the node's")"
fi
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

with_progress() {  # WHAT LOG COMMAND...: run it, saying every 30 s that it still runs, with its log's last line
    local what=$1 log=$2 t0=$SECONDS waited; shift 2
    "$@" >>"$log" 2>&1 &
    building=$!
    while kill -0 "$building" 2>/dev/null; do
        for ((waited = 0; waited < 30; waited++)); do kill -0 "$building" 2>/dev/null && sleep 1 || break; done
        ! kill -0 "$building" 2>/dev/null || say "$what: $((SECONDS - t0)) s so far ($(tail -n 1 "$log" | cut -c1-100))"
    done
    wait "$building"
    local rc=$?
    building=""
    return "$rc"
}

say "this project as a wheel (built from a copy: the checkout stays as it is)"
mkdir "$work/src"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work/src"
pip_ wheel -q --no-deps -w "$DIR" "$work/src" >"$work/project.log" 2>&1 || {
    echo "wheelhouse.sh: could not build this project's wheel:" >&2; tail -20 "$work/project.log" >&2; exit 1; }
project=$(basename "$(ls "$DIR"/vasso_plugins-*.whl)")

build_sdist() {  # NAME==VERSION: a wheel from PyPI's source, checked against the target
    local req=$1 before after built
    before=$(ls "$DIR")
    : >"$work/build.log"
    # the builder's own setuptools, torch, numpy and cython first (fairseq-fixed compiles against
    # torch: an isolated build would fetch the newest torch, so it gets no second try), then an
    # isolated build
    if ! with_progress "building $req" "$work/build.log" \
            "$PY" -m pip --disable-pip-version-check wheel -v --no-deps --no-build-isolation \
            --no-binary "${req%%==*}" -w "$DIR" "$req"; then
        if [ "$req" = "$FAIRSEQ" ] || ! with_progress "building $req (isolated)" "$work/build.log" \
                "$PY" -m pip --disable-pip-version-check wheel -v --no-deps --no-binary "${req%%==*}" -w "$DIR" "$req"; then
            echo "wheelhouse.sh: could not build $req from source:" >&2; tail -20 "$work/build.log" >&2; exit 1
        fi
    fi
    after=$(ls "$DIR")
    built=$(comm -13 <(echo "$before") <(echo "$after") | head -1)
    case "$built" in
        *-none-any.whl) say "built $built (pure Python)" ;;
        *) if [ "$here_version" != "$PYVER" ]; then
               rm -f "$DIR/$built"
               echo "wheelhouse.sh: $req has compiled code and PyPI has no wheel of it for Python $PYVER on" \
                    "$PLATFORM; build it with a Python $PYVER (PYTHON=/path/to/python$PYVER, with torch," \
                    "numpy and cython installed) or on the node" >&2
               exit 1
           fi
           say "built $built with $PY (Python $here_version, torch $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none))" ;;
    esac
}

# resolve for the target, binary wheels only; a package with no wheel for it is built from source
# and the resolution tried again
declare -A built_names=()
reqs=("vasso-plugins[$EXTRAS]")
[ -z "$TORCH" ] || reqs+=("torch==$TORCH")
for attempt in $(seq 1 12); do
    say "resolving ${reqs[*]} for Python $PYVER on $PLATFORM (attempt $attempt)"
    if pip_ install -q --dry-run --ignore-installed --report "$work/report.json" --target "$work/target" \
            --only-binary :all: "${target[@]}" --find-links "$DIR" "${LINKS[@]}" "${CONSTRAINTS[@]}" "${reqs[@]}" \
            >"$work/resolve.log" 2>&1; then
        break
    fi
    missing=$(sed -n 's/.*No matching distribution found for \([^ ;]*\).*/\1/p' "$work/resolve.log" | head -1)
    [ -n "$missing" ] || { echo "wheelhouse.sh: pip could not resolve the set:" >&2; tail -20 "$work/resolve.log" >&2; exit 1; }
    name=${missing%%[=<>!~ ;]*}
    if [ -n "${built_names[$name]:-}" ]; then
        echo "wheelhouse.sh: pip does not take the wheel of $name built here for Python $PYVER on $PLATFORM:" >&2
        tail -5 "$work/resolve.log" >&2; exit 1
    fi
    built_names[$name]=1
    if [[ "$name" =~ $TORCH_STACK ]]; then
        echo "wheelhouse.sh: PyPI has no $missing for Python $PYVER on $PLATFORM (give the node's torch with --torch)" >&2
        exit 1
    fi
    # the version the target needs: what pip would pick from the source releases
    version=$(pip_ index versions "$name" 2>/dev/null | sed -n 's/^Available versions: \([^,]*\).*/\1/p' || true)
    case "$missing" in *==*) version=${missing#*==} ;; esac
    [ -n "$version" ] || { echo "wheelhouse.sh: no release of $name found" >&2; exit 1; }
    say "no wheel of $name for the target: building $name==$version from its source"
    build_sdist "$name==$version"
    [ "$attempt" -lt 12 ] || { echo "wheelhouse.sh: still unresolved after 12 attempts" >&2; exit 1; }
done

# every package pip chose, less the torch stack: downloaded (binary wheels) unless built above
"$PY" - "$work/report.json" "$TORCH_STACK" >"$DIR/requirements.txt" <<'PY'
import json, re, sys
report = json.load(open(sys.argv[1]))
stack = re.compile(sys.argv[2])
for item in sorted(report["install"], key=lambda i: i["metadata"]["name"].lower()):
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not stack.match(name.lower()):
        print(f"{name}=={version}")
PY
say "downloading $(wc -l <"$DIR/requirements.txt") wheels (the torch stack left to the node)"
pip_ download -q --no-deps --only-binary :all: "${target[@]}" --find-links "$DIR" "${LINKS[@]}" -d "$DIR" \
    -r "$DIR/requirements.txt" >"$work/download.log" 2>&1 || {
    echo "wheelhouse.sh: download failed:" >&2; tail -20 "$work/download.log" >&2; exit 1; }
say "done: $DIR ($(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1)); the project: $project"
echo "On the node: bash scripts/test_gpu.sh --wheelhouse $DIR   (copy the folder there first)"
