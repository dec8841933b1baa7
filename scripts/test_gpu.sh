#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU, without network (a cluster's compute node):
#   bash scripts/test_gpu.sh --wheelhouse DIR   a venv over the node's own torch (VENV, default
#                                               .venv-gpu: python3 -m venv --system-site-packages;
#                                               PYTHON picks the node's python3), with this project
#                                               and its extras from DIR (pip install --no-index;
#                                               DIR made by scripts/wheelhouse.sh on a machine with network)
#   bash scripts/test_gpu.sh --python PATH      a Python that has everything already (torch with CUDA,
#                                               fairseq, fairscale, ...)
#   bash scripts/test_gpu.sh                    .venv/bin/python (scripts/setup_env.sh's)
# It never installs from the network. Before any work it says what the node lacks, each with its
# one-line fix: a torch, a GPU that torch sees, and with --wheelhouse a pip for the venv (PYTHON's,
# else ensurepip's: Debian's python3.X-venv) stop it; without nvidia-smi the GPUs are counted by
# torch; without torchvision part 4 runs the transformer alone (and DomainBed, which imports it, is
# left out); without DomainBed its self-test rows skip. Then, timed part by part:
#   1. the self-test, `python -m plugins.lab.selftest --ranks 2` on every device (its table);
#   2. every test that needs a GPU (the `gpu` and `two_gpus` markers: pytest -m "gpu or two_gpus"
#      plugins tests); on one GPU the `two_gpus` tests are reported as not run, with the reason;
#   3. tests/selftest's tests of the self-test, reading part 1's report (not running it again);
#   4. the device benchmark, `python scripts/benchmark/benchmark.py --device cuda --quick --adamw fused
#      --steps-per-round 3 --seconds 45` (about 2 minutes; fused AdamW everywhere: the base that takes
#      torch's found_inf, so that the family's steps run without a host sync, docs/design.md, "Where a step is decided";
#      3 steps per round: one step's ratio spread +-5-10 % on an H100, too wide for the 1.02/1.03 goals;
#      30 rounds at least, more while 45 s per model last: more rounds narrow the verdicts' intervals;
#      the step-cost verdicts where the spread allows one; REFERENCE_VASSO=DIR and REFERENCE_SAM=DIR,
#      checkouts of BingcongLi/VaSSO and davda54/sam, add the anchors' rows). Its verdicts inform,
#      they do not fail the check (scripts/benchmark/benchmark.py --fail-on-miss does).
# A test that skips for lack of a GPU fails here (VASSO_REQUIRE_GPU=1), but for a `two_gpus` test on
# one GPU. DomainBed is found as everywhere (DOMAINBED_ROOT, the environment's copy,
# ../shared/DomainBed beside this checkout).
# --node-platform: print the scripts/wheelhouse.sh command for this node (PYTHON's version, its
# platform from the machine and the glibc, its torch) and stop. --install-only: set up the
# --wheelhouse venv and stop (no GPU needed). The venv gets every package
# of DIR/requirements.txt from DIR, in its own site-packages (the node's copies of them stay where
# they are, unused; the torch stack is the node's): the set-up lists them and fails unless each is
# then imported from the venv at DIR's version, and where one breaks a node package the venv sees
# too (pip check, before and after), naming the constraints for scripts/wheelhouse.sh --constraint.
# The venv is made again when the wheelhouse, the Python or its torch changed, and a failed set-up
# removes it. Arguments after -- go to part 2's pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }  # the comment above
WHEELHOUSE="" PY="" INSTALL_ONLY=0 NODE_PLATFORM=0 PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheelhouse) WHEELHOUSE=${2:-}; [ -n "$WHEELHOUSE" ] || { echo "test_gpu.sh: --wheelhouse needs a folder" >&2; exit 2; }; shift 2 ;;
        --python) PY=${2:-}; [ -n "$PY" ] || { echo "test_gpu.sh: --python needs a path" >&2; exit 2; }; shift 2 ;;
        --install-only) INSTALL_ONLY=1; shift ;;
        --node-platform) NODE_PLATFORM=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "test_gpu.sh: unknown argument $1 (pytest's arguments go after --; see --help)" >&2; exit 2 ;;
    esac
done
if [ "$NODE_PLATFORM" = 1 ]; then  # the node's Python, as --wheelhouse takes it (PYTHON), or --python's
    exec "${PY:-${PYTHON:-python3}}" - <<'PY'
import importlib.metadata, os, platform, sys

libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {}) else ""
if not libc.startswith("glibc "):
    sys.exit(f"test_gpu.sh: no glibc found ({libc or 'none'}): this node takes no manylinux wheels")
major, minor = libc.split()[1].split(".")[:2]
try:
    torch = importlib.metadata.version("torch").split("+")[0]
except importlib.metadata.PackageNotFoundError:
    sys.exit(f"test_gpu.sh: {sys.executable} has no torch: PYTHON=/path/to/python3 names the node's Python, "
             "the one with its torch")
version = f"{sys.version_info[0]}.{sys.version_info[1]}"
print(f"PYTHON=/path/to/python{version} bash scripts/wheelhouse.sh /tmp/vasso-wheels --python-version {version} "
      f"--platform manylinux_{major}_{minor}_{platform.machine()} --torch {torch}")
PY
fi
if [ -n "$WHEELHOUSE" ] && [ -n "$PY" ]; then
    echo "test_gpu.sh: give --wheelhouse DIR or --python PATH, not both" >&2; exit 2
fi
if [ -n "$WHEELHOUSE" ]; then
    [ -f "$WHEELHOUSE/requirements.txt" ] && ls "$WHEELHOUSE"/vasso_plugins-*.whl >/dev/null 2>&1 || {
        echo "test_gpu.sh: --wheelhouse $WHEELHOUSE: no requirements.txt and vasso_plugins wheel there" \
             "(make it with scripts/wheelhouse.sh on a machine with network)" >&2; exit 2; }
    WHEELHOUSE=$(cd "$WHEELHOUSE" && pwd)
elif [ "$INSTALL_ONLY" = 1 ]; then
    echo "test_gpu.sh: --install-only installs from --wheelhouse DIR" >&2; exit 2
fi
if [ -n "$PY" ] && ! [ -x "$PY" ]; then
    echo "test_gpu.sh: --python $PY: not an executable" >&2; exit 2
fi

START=$SECONDS
stage() { echo "[test_gpu $((SECONDS - START)) s] $*"; }

# ---------------------------------------------------------------- what the node lacks, before any work
# the Python whose torch the check uses: the venv's base with --wheelhouse
if [ -n "$WHEELHOUSE" ]; then
    BASE=$(command -v "${PYTHON:-python3}") || BASE=""
    [ -n "$BASE" ] || { echo "test_gpu.sh: no ${PYTHON:-python3} on PATH: PYTHON=/path/to/python3 names the node's" \
                             "Python, the one with its torch" >&2; exit 2; }
    fix_python="PYTHON=/path/to/the/node's/python3 (the one with its torch) bash scripts/test_gpu.sh --wheelhouse $WHEELHOUSE"
else
    BASE=${PY:-.venv/bin/python}
    [ -x "$BASE" ] || { echo "test_gpu.sh: no Python at $BASE: give --wheelhouse DIR or --python PATH" \
                             "(or make .venv with bash scripts/setup_env.sh)" >&2; exit 2; }
    fix_python="--python PATH naming a Python that has it, or --wheelhouse DIR (scripts/wheelhouse.sh) over the node's Python"
fi
declare -A node=()
# one KEY=VALUE a line; DomainBed found as the tests find it (this checkout's domainbed_vasso)
while IFS='=' read -r key value; do [ -n "$key" ] && node[$key]=$value; done < <(
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$BASE" - "$INSTALL_ONLY" <<'PY' 2>/dev/null
import importlib, importlib.util, sys

def why(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False

print(f"python={sys.version_info[0]}.{sys.version_info[1]}")
print(f"prefix={sys.prefix}")
try:  # the installed torch's version, the same with --install-only and without (the venv's stamp)
    import importlib.metadata
    print(f"torch_dist={importlib.metadata.version('torch')}")
except Exception:
    pass
for name in ("ensurepip", "pip", "fairseq"):
    print(f"{name}={int(found(name))}")
if sys.argv[1] == "1":  # --install-only: found, and its version, without the seconds of an import
    try:
        import importlib.metadata
        print(f"torch={importlib.metadata.version('torch')}" if found("torch") else "torch_error=not installed")
    except Exception as exc:
        print(f"torch_error={why(exc)}")
else:
    try:
        import torch
        print(f"torch={torch.__version__}")
        print(f"cuda_build={torch.version.cuda}")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"gpus={count}")
        if count:
            print(f"gpu_name={torch.cuda.get_device_name(0)}")
    except Exception as exc:
        print(f"torch_error={why(exc)}")
if sys.argv[1] == "0":
    try:
        import torchvision
        print(f"torchvision={torchvision.__version__}")
    except Exception as exc:  # not there, or built for another torch
        print(f"torchvision_error={why(exc)}")
    try:
        import domainbed_vasso
        print(f"domainbed={domainbed_vasso.domainbed_root()}")
    except Exception as exc:
        print(f"domainbed_error={why(exc)}")
PY
)
lacks=() fatal=0
lack() { lacks+=("$1"); [ "${2:-}" != fatal ] || fatal=1; }  # LINE [fatal]
if [ -z "${node[python]:-}" ]; then
    lack "a working Python: $BASE did not run; fix: $fix_python" fatal
elif [ -z "${node[torch]:-}" ]; then
    lack "torch: $BASE has none that imports (${node[torch_error]:-}); the wheelhouse leaves torch to the node; fix: $fix_python" fatal
fi
if [ -n "$WHEELHOUSE" ] && [ -n "${node[python]:-}" ] && [ "${node[ensurepip]:-0}" = 0 ] && [ "${node[pip]:-0}" = 0 ]; then
    lack "ensurepip and pip (python3 -m venv needs one of them): $BASE has neither; fix: install python${node[python]}-venv (Debian, Ubuntu), or $fix_python" fatal
fi
if [ -z "$WHEELHOUSE" ] && [ -n "${node[python]:-}" ] && [ "${node[fairseq]:-0}" = 0 ]; then
    lack "fairseq: $BASE has none; fix: --wheelhouse DIR (from scripts/wheelhouse.sh), or bash scripts/setup_env.sh for .venv" fatal
fi
if [ "$INSTALL_ONLY" = 0 ] && [ -n "${node[torch]:-}" ]; then
    smi_gpus=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        smi_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    else
        lack "nvidia-smi: not on PATH (some containers show the GPU to torch without it): the GPUs are counted by torch, and the benchmark's report names no driver; fix: PATH=/path/to/the/driver/bin:\$PATH"
    fi
    if [ "${node[gpus]:-0}" = 0 ]; then
        if [ -n "$smi_gpus" ] && [ "$smi_gpus" != 0 ]; then
            lack "a GPU that torch sees: nvidia-smi lists $smi_gpus, torch ${node[torch]} (CUDA build: ${node[cuda_build]:-none}) sees none; fix: CUDA_VISIBLE_DEVICES unset or naming GPUs, and a CUDA build of torch: $fix_python" fatal
        else
            lack "an NVIDIA GPU: no NVIDIA GPU found (nvidia-smi -L ${smi_gpus:+lists none}${smi_gpus:-is not there}, torch sees none): this command is for a machine with GPUs; the CPU suite is 'bash scripts/test.sh -ra', and --install-only sets the venv up without a GPU" fatal
        fi
    elif [ "${node[gpus]}" = 1 ]; then
        echo "[test_gpu] one GPU: the tests that need two (the \`two_gpus\` marker) are reported as not run"
    fi
    if [ -z "${node[torchvision]:-}" ]; then
        lack "torchvision (${node[torchvision_error]:-}): part 4 benchmarks the transformer alone (resnet50 needs it)${node[domainbed]:+, and DomainBed, which imports it, is left out}; fix: pip install into $BASE the torchvision built for torch ${node[torch]} (offline: its wheel from download.pytorch.org)"
        if [ -n "${node[domainbed]:-}" ]; then
            unset DOMAINBED_ROOT; export DOMAINBED_VASSO_BESIDE=0  # its self-test rows skip, saying so
            node[domainbed]=""
        fi
    fi
    if [ -z "${node[domainbed]:-}" ] && [ -n "${node[domainbed_error]:-}" ]; then
        lack "DomainBed (${node[domainbed_error]}): its self-test rows skip; fix: export DOMAINBED_ROOT=/path/to/DomainBed (a checkout at b93c22a, docs/domainbed.md)"
    fi
fi
if [ -n "${node[torch]:-}" ]; then
    line="[test_gpu] node: $BASE (Python ${node[python]}), torch ${node[torch]}"
    [ "$INSTALL_ONLY" = 1 ] || line+=" (CUDA build: ${node[cuda_build]:-none})"
    line+="${node[gpus]:+, ${node[gpus]} GPU(s) seen by torch}${node[gpu_name]:+ (${node[gpu_name]})}"
    echo "$line${node[torchvision]:+, torchvision ${node[torchvision]}}${node[domainbed]:+, DomainBed at ${node[domainbed]}}"
fi
if [ ${#lacks[@]} -gt 0 ]; then
    echo "[test_gpu] what this node lacks, each with its fix:"
    for line in "${lacks[@]}"; do echo "  - $line"; done
fi
if [ "$fatal" = 1 ]; then
    echo "test_gpu.sh: nothing was run or installed: the node lacks what the check needs (above)" >&2
    exit 1
fi

# ---------------------------------------------------------------- the venv, from the wheelhouse
if [ -n "$WHEELHOUSE" ]; then
    VENV=${VENV:-.venv-gpu}
    case "$VENV" in /*) venv_path=$VENV ;; *) venv_path=$PWD/$VENV ;; esac
    stamp=$( (cat "$WHEELHOUSE/requirements.txt"; ls "$WHEELHOUSE"; echo "${node[prefix]} ${node[torch_dist]:-}") \
             | sha256sum | cut -c1-16)
    if [ "$(cat "$VENV/.wheelhouse-stamp" 2>/dev/null)" = "$stamp" ] && [ -x "$VENV/bin/python" ]; then
        stage "$VENV: installed from this wheelhouse over $BASE already"
    else
        if [ -e "$VENV" ]; then
            # one this script made (its mark, or the default folder holding a venv): made again
            if [ -f "$VENV/.made-by-test-gpu" ] || { [ "$VENV" = .venv-gpu ] && [ -f "$VENV/pyvenv.cfg" ]; }; then
                stage "$VENV: made again (another wheelhouse, Python or torch than its own, or an unfinished set-up)"
                rm -rf "$VENV"
            else
                echo "test_gpu.sh: VENV=$VENV exists and is not a venv this script made: name another folder" >&2
                exit 2
            fi
        fi
        # a set-up that fails or is interrupted leaves no venv behind to mislead the next try
        trap 'rm -rf "$VENV"; echo "test_gpu.sh: the set-up did not finish: $VENV removed" >&2' EXIT
        # pip: $BASE's where it has one (seen through the system site packages: no ensurepip needed,
        # and seconds saved), else the venv's own from ensurepip
        venv_args=(--system-site-packages)
        [ "${node[pip]}" = 0 ] || venv_args+=(--without-pip)
        stage "creating $VENV over $BASE's packages (its torch$([ "${node[pip]}" = 0 ] && echo "; pip from ensurepip" \
              || echo ", its pip"))"
        "$BASE" -m venv "${venv_args[@]}" "$VENV" || exit 1
        touch "$VENV/.made-by-test-gpu"
        # a PYTHON that is itself a venv: --system-site-packages sees its base's packages, not its
        # own (where the node's torch may be): a .pth file adds them behind the new venv's
        "$BASE" -c 'import sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))' \
            > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/node_packages.pth" || exit 1
        "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(not all(map(importlib.util.find_spec, ('torch', 'pip'))))" \
            || { echo "test_gpu.sh: $VENV does not see $BASE's torch and pip" >&2; exit 1; }
        # the venv sees the node's packages, and the wheelhouse's copy of one shadows the node's: a
        # node package that needs the node's version (a node's transformers pinning huggingface-hub
        # below the wheelhouse's) then breaks, and with it what imports it. pip check before the
        # install and after it: the conflicts the install brought stop the set-up
        conflicts() { PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip --isolated check --disable-pip-version-check \
                          2>/dev/null | grep " has requirement " | sort; }
        node_conflicts=$(conflicts)
        stage "installing the $(grep -c . "$WHEELHOUSE/requirements.txt") packages of $WHEELHOUSE/requirements.txt" \
              "from it into $VENV (no index, no network, no pip configuration)"
        # pinned by wheelhouse.sh's resolution; --no-deps: the torch stack is the node's own;
        # --ignore-installed: into the venv, also those the node has (else pip takes the node's and
        # the wheelhouse goes untried); --isolated and no configuration file: DIR only, never another
        # folder or index that a pip.conf or PIP_* names
        PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip --isolated install -q --disable-pip-version-check \
            --no-index --find-links "$WHEELHOUSE" --no-deps --ignore-installed -r "$WHEELHOUSE/requirements.txt" \
            || exit 1
        # each requirement must now be imported from the venv at the wheelhouse's version
        installed=$(cd / && env -u PYTHONPATH "$venv_path/bin/python" - "$WHEELHOUSE/requirements.txt" "$venv_path" <<'PY'
import importlib.metadata, os, re, sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

venv = os.path.realpath(sys.argv[2])
first = {}
for dist in importlib.metadata.distributions():  # in sys.path's order: the first of a name is the one imported
    first.setdefault(norm(dist.metadata["Name"] or ""), dist)
ok, wrong = [], []
for line in open(sys.argv[1], encoding="utf-8"):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    dist = first.get(norm(name))
    where = os.path.realpath(str(dist.locate_file(""))) if dist else ""
    if dist is None:
        wrong.append(f"{name}: not installed")
    elif dist.version != version:
        wrong.append(f"{name}: {dist.version} is the one imported ({where}), the wheelhouse's is {version}")
    elif not (where + os.sep).startswith(venv + os.sep):
        wrong.append(f"{name} {version}: the node's copy ({where}) is the one imported, not the wheelhouse's")
    else:
        ok.append(f"{name}=={version}")
if wrong:
    sys.exit("the wheelhouse was not used for:\n  " + "\n  ".join(wrong))
print(" ".join(ok))
PY
) || { echo "test_gpu.sh: the install from $WHEELHOUSE did not take (above)" >&2; exit 1; }
        brought=$(comm -13 <(echo "$node_conflicts") <(conflicts))
        if [ -n "$brought" ]; then
            { echo "test_gpu.sh: the wheelhouse's packages break packages of the node that $VENV sees too (pip check):"
              sed 's/^/    /' <<<"$brought"
              echo "  fix: make the wheelhouse again with the node's needs kept: a file of these lines, named by"
              echo "  --constraint FILE on the scripts/wheelhouse.sh command (test_gpu.sh --node-platform prints it):"
              sed -E 's/^.* has requirement (.*), but you have .*$/    \1/' <<<"$brought" | sort -u
            } >&2
            exit 1
        fi
        stage "installed from the wheelhouse into $VENV ($(wc -w <<<"$installed") packages, each imported from there):"
        fold -s -w 100 <<<"$installed" | sed 's/^/    /'
        stage "from the node ($BASE): torch ${node[torch]}${node[torchvision]:+, torchvision ${node[torchvision]}}"
        echo "$stamp" > "$VENV/.wheelhouse-stamp"
        trap - EXIT
    fi
    PY=$venv_path/bin/python
    # the venv's own copy of this project (the wheel), from outside the checkout
    (cd / && env -u PYTHONPATH "$PY" -W ignore -c "import torch, fairseq, plugins; print('[test_gpu] torch', torch.__version__, '| CUDA', torch.version.cuda, '| fairseq', fairseq.__version__, '| plugins from', plugins.__file__)") || exit 1
else
    PY=$BASE
    PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -W ignore -c "import torch, fairseq, plugins; print('[test_gpu] torch', torch.__version__, '| CUDA', torch.version.cuda, '| fairseq', fairseq.__version__)" || exit 1
fi
[ "$INSTALL_ONLY" = 0 ] || { stage "installed: $PY (--install-only)"; exit 0; }

# ---------------------------------------------------------------- the check
# this checkout's code first (the wheel's copy may be older), one thread per test process
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
run=$(mktemp -d "${TMPDIR:-/tmp}/vasso-test-gpu.XXXXXX")
trap 'rm -rf "$run"' EXIT
names=() times=() results=() failed=0
part() {  # NAME COMMAND...: run it, keep its time and result
    local name=$1 t0=$SECONDS rc; shift
    stage "part $((${#names[@]} + 1)): $name"
    "$@"
    rc=$?
    names+=("$name") times+=($((SECONDS - t0)))
    if [ "$rc" = 0 ]; then results+=(ok); else results+=("FAILED (exit $rc)"); failed=1; fi
}
selftest() {
    "$PY" -m plugins.lab.selftest --ranks 2 --json "$run/report.json" 2>&1 | tee "$run/output.txt"
    local rc=${PIPESTATUS[0]}
    echo "$rc" > "$run/returncode"
    return "$rc"
}
gpu_tests() {
    env VASSO_REQUIRE_GPU=1 VASSO_SELFTEST_RUN="$run" "$PY" -m pytest -ra -m "gpu or two_gpus" plugins tests \
        "${PYTEST_ARGS[@]}" 2>&1 | tee "$run/gpu-tests.txt"
    return "${PIPESTATUS[0]}"
}
part "self-test (every device)" selftest
part "gpu tests (-m gpu, two_gpus)" gpu_tests
# -ra's summary folds the skips of one place and reason into one line: "SKIPPED [N] place: reason"
not_run=$(sed -n 's/^SKIPPED \[\([0-9]*\)\] .*needs two CUDA devices, this machine has.*/\1/p' "$run/gpu-tests.txt" \
          | awk '{ n += $1 } END { print n + 0 }')
[ "$not_run" = 0 ] || results[${#results[@]}-1]+=" ($not_run two_gpus test(s) not run: one GPU)"
part "self-test's tests (its report)" env VASSO_SELFTEST_RUN="$run" \
    "$PY" -m pytest -ra tests/selftest/test_selftest_command.py
[ -n "${node[torchvision]:-}" ] || stage "part 4 runs the transformer alone: no torchvision (above)"
part "device benchmark (--quick)" "$PY" scripts/benchmark/benchmark.py --device cuda --quick --adamw fused --steps-per-round 3 \
    --seconds 45 \
    ${REFERENCE_VASSO:+--reference-vasso "$REFERENCE_VASSO"} ${REFERENCE_SAM:+--reference-sam "$REFERENCE_SAM"}

echo
echo "===== GPU check: time of each part"
printf '%-32s %8s  %s\n' "part" "time" "result"
for i in "${!names[@]}"; do printf '%-32s %6d s  %s\n' "${names[$i]}" "${times[$i]}" "${results[$i]}"; done
printf '%-32s %6d s\n' "total (with the set-up)" $((SECONDS - START))
exit "$failed"
