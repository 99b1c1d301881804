#!/usr/bin/env bash
# Trained weights for docs/analysis.md: three tiny ViTs (4 blocks, width 64, patch 4 on 32x32)
# trained for 300 steps of batch 64 (about 0.4 epoch) on CIFAR-10, one CPU thread each:
# vanilla (timm Block + Mlp), IFFN in place of the Mlp, MABViT GLU on the value.
# Usage: nice -n 10 scripts/train_analysis_demo.sh [DATA=/work/shared/data/cifar10] [OUT=runs/analysis]
set -euo pipefail
DATA=${1:-/work/shared/data/cifar10}
OUT=${2:-runs/analysis}
KW='model_kwargs={img_size: 32, patch_size: 4, depth: 4, embed_dim: 64, num_heads: 2}'
for model in deit_tiny_patch16_224 iffn_deit_tiny_patch16_224 mabvit_glu_vit_tiny_patch16_224; do
  vitblocks train --model "$model" --data "$DATA" --config ninformer --batch-size 64 --max-steps 300 \
      --threads 1 --output "$OUT" --name "$model" "$KW" mlp_drop=0 val_subset=2000
done
