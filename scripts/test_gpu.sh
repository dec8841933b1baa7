#!/usr/bin/env bash
# The CUDA tests of tests/, on a machine with GPUs: every test whose id names cuda (the
# `cuda` cases of tests/core/test_mixed_precision.py, tests/fairseq's end-to-end precision
# modes) and tests/selftest/test_selftest_command.py (vasso-selftest on every device found),
# through the project's test command (scripts/test.sh: it sets up .venv first).
# Fails without a GPU, and when a CUDA test skips for lack of one. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "scripts/test_gpu.sh: no NVIDIA GPU found (nvidia-smi -L): this command is for a machine with GPUs;" \
         "the CPU suite is 'bash scripts/test.sh -ra'" >&2
    exit 1
fi
log=$(mktemp "${TMPDIR:-/tmp}/vasso-test-gpu.XXXXXX")
trap 'rm -f "$log"' EXIT
bash scripts/test.sh -ra -k "cuda or test_selftest_command" plugins tests "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# the reasons the CUDA tests give when torch sees no GPU
if grep -E "^SKIPPED.*(no CUDA device|needs a CUDA device)" "$log" >/dev/null; then
    echo "scripts/test_gpu.sh: CUDA tests skipped for lack of a CUDA device although nvidia-smi lists a GPU" \
         "(is this torch a CUDA build? python -m torch.utils.collect_env)" >&2
    rc=1
fi
exit "$rc"
