#!/usr/bin/env bash
# The VASSO paper's DomainBed experiment (Table "tab.domain" and appendix tables):
# ERM (Adam), SAM, GSAM and VASSO on PACS, VLCS, OfficeHome and TerraIncognita,
# DomainBed's default random search (20 hparams x 3 trials, every 1- and 2-test-env
# combination, as leave-one-domain-out model selection needs), ImageNet ResNet-50
# from torchvision.
#
#   DATA_DIR=./domainbed/data OUTPUT_DIR=./sweep_vasso LAUNCHER=multi_gpu \
#       bash scripts/domainbed/paper_sweep.sh                 # launch
#   bash scripts/domainbed/paper_sweep.sh delete_incomplete   # then launch again to resume
#   vasso-domainbed-tables ./sweep_vasso                      # the tables, paper beside yours
#
# Environment (all optional but DATA_DIR): PYTHON (default: python), OUTPUT_DIR
# (default ./sweep_vasso), LAUNCHER (local | multi_gpu | dummy | ..., default local),
# N_HPARAMS (20), N_TRIALS (3), DATASETS, ALGORITHMS, RECIPE_HPARAMS (JSON given to
# every run, default below), DOMAINBED_ROOT (the DomainBed checkout, unless it is on
# PYTHONPATH), DOMAINBED_VASSO_NUM_WORKERS, DOMAINBED_VASSO_RESNET_WEIGHTS.
# Extra arguments after the command go to DomainBed's sweep (e.g. --steps 5001,
# --skip_confirmation).
#
# RECIPE_HPARAMS default: {"resnet50_augmix": false, "freeze_bn": true}
#   resnet50_augmix false: torchvision's ImageNet ResNet-50 (the paper's backbone)
#     instead of timm's AugMix ResNet-50 that DomainBed b93c22a uses by default;
#   freeze_bn true: BatchNorm layers in eval mode, as the DomainBed of the paper's
#     time (and SAGM's code, whose Adam/SAM/GSAM numbers the paper quotes) always did.
# With the random search, DomainBed draws the other hparams (lr, batch size, weight
# decay, dropout) per hparams_seed, identically for the four algorithms.
set -euo pipefail

COMMAND="${1:-launch}"
shift || true
: "${DATA_DIR:?set DATA_DIR to the DomainBed data directory (python -m domainbed.scripts.download)}"
PYTHON="${PYTHON:-python}"
OUTPUT_DIR="${OUTPUT_DIR:-./sweep_vasso}"
LAUNCHER="${LAUNCHER:-local}"
N_HPARAMS="${N_HPARAMS:-20}"
N_TRIALS="${N_TRIALS:-3}"
DATASETS="${DATASETS:-PACS VLCS OfficeHome TerraIncognita}"
ALGORITHMS="${ALGORITHMS:-ERM SAM GSAM VASSO}"
DEFAULT_HPARAMS='{"resnet50_augmix": false, "freeze_bn": true}'
RECIPE_HPARAMS="${RECIPE_HPARAMS:-$DEFAULT_HPARAMS}"

# shellcheck disable=SC2086  # DATASETS and ALGORITHMS are word lists
exec "$PYTHON" -m domainbed_vasso.sweep "$COMMAND" \
    --data_dir "$DATA_DIR" --output_dir "$OUTPUT_DIR" \
    --datasets $DATASETS --algorithms $ALGORITHMS \
    --n_hparams "$N_HPARAMS" --n_trials "$N_TRIALS" \
    --command_launcher "$LAUNCHER" \
    --hparams "$RECIPE_HPARAMS" "$@"
