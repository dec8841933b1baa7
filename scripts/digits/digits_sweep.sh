#!/usr/bin/env bash
# Domain shift at CPU scale (the VASSO paper's tab.domain, leave-one-domain-out):
# DomainBed's sweep of ERM, SAM and VASSO over RotatedDigits (scikit-learn's digits,
# one domain per rotation angle: domainbed_vasso/digits_dataset.py), then the table.
#
#   bash scripts/digits/digits_sweep.sh [OUTPUT_DIR]
#
# DomainBed is found as domainbed_vasso finds it: DOMAINBED_ROOT when set, else the copy
# `bash scripts/setup_env.sh --with-domainbed` installed into .venv (or PYTHONPATH);
# without one it stops at once with the fix.
#
# OUTPUT_DIR defaults to sweep/digits (git-ignored). Re-running resumes: DomainBed's
# sweep skips the jobs that are done. 3 algorithms x 3 trials x 10 test-domain sets
# (4 single + 6 pairs, the pairs being what leave-one-domain-out selection needs)
# = 90 jobs of 301 steps, default hparams (hparams_seed 0: rho 0.05, VASSO theta 0.4,
# Adam lr 1e-3, batch 64 per domain, MLP featurizer 64-128-128). Each child runs on
# one thread (OMP_NUM_THREADS=1). Extra arguments go to the sweep (e.g. --n_trials 1).
# The sweep's own output (DomainBed prints every job's log) goes to OUTPUT_DIR/sweep.log;
# stdout gets the tables only (vasso-domainbed-tables, with the paper's tab.domain).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-sweep/digits}
shift || true
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# before anything is written, and on the terminal (the sweep's own output goes to its log)
"$PY" -c 'import sys, domainbed_vasso
try:
    domainbed_vasso.register()
except domainbed_vasso.DomainBedNotFound as exc:
    sys.exit(f"digits_sweep.sh: error: {exc}")'
HPARAMS='{"mlp_width": 128, "mlp_depth": 3, "mlp_dropout": 0.0, "lr": 0.001, "batch_size": 64}'
mkdir -p "$OUT"
"$PY" -m domainbed_vasso.sweep launch --datasets RotatedDigits --algorithms ERM SAM VASSO \
    --data_dir "$OUT/unused_data_dir" --output_dir "$OUT" --command_launcher local \
    --n_hparams 1 --n_trials 3 --hparams "$HPARAMS" --skip_confirmation "$@" >> "$OUT/sweep.log" 2>&1
echo "sweep: $(grep -c . <(ls -d "$OUT"/*/done 2>/dev/null)) jobs done (log: $OUT/sweep.log)" >&2
"$PY" -m domainbed_vasso.tables "$OUT" --datasets RotatedDigits --selection loo iid --paper_summary
