#!/usr/bin/env bash
# Trained weights for docs/analysis.md: three tiny ViTs (4 blocks, width 64, patch 4 on 32x32)
# trained on CIFAR-10 with batch 64 on one CPU thread: vanilla (timm Block + Mlp, 300 steps),
# IFFN in place of the Mlp and MABViT GLU on the value (150 steps each: the IFFN run was
# cut short on the shared 2-core machine, see docs/analysis.md).
# Usage: nice -n 10 scripts/train_analysis_demo.sh [DATA=/work/shared/data/cifar10] [OUT=runs/analysis]
set -euo pipefail
DATA=${1:-/work/shared/data/cifar10}
OUT=${2:-runs/analysis}
KW='model_kwargs={img_size: 32, patch_size: 4, depth: 4, embed_dim: 64, num_heads: 2}'
train() {  # MODEL STEPS
  vitblocks train --model "$1" --data "$DATA" --config ninformer --batch-size 64 --max-steps "$2" \
      --threads 1 --output "$OUT" --name "$1" "$KW" mlp_drop=0 val_subset=2000
}
train deit_tiny_patch16_224 300
train iffn_deit_tiny_patch16_224 150
train mabvit_glu_vit_tiny_patch16_224 150
