#!/usr/bin/env bash
# NiNformer Table 1, the paper's 100-epoch protocol, all 8 runs at once on one GPU.
# Usage: bash scripts/gpu_table1.sh [SECONDS]   (a time budget; default 555 s per call)
# Needs .gpu_data/mnist and .gpu_data/cifar10 (copies of the WebDataset shards, git-ignored) and a
# python3 with torch + timm; writes runs/gpu-t1 and, where $OUT is set (the workplace's device tool),
# a tarball of the metrics there. Re-running continues interrupted runs (resumed from last.pth).
# Results and discussion: docs/training.md, "The full protocol on one H100".
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
budget=${1:-555}
timeout -s INT $budget python3 -m vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --jobs 8 \
  --data-root .gpu_data --output runs/gpu-t1 --device cuda \
  --set compile=true compile_mode=reduce-overhead deterministic=false progress=none >> reproduce.log 2>&1
echo "reproduce exit $?"
pkill -INT -f "vitblocks reproduce"; sleep 5; pkill -9 -f "vitblocks reproduce"
tail -14 reproduce.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[ -n "$OUT" ] && tar czf $OUT/gpu-t1.tgz --exclude='*.pth' runs/gpu-t1 reproduce.log
for f in runs/gpu-t1/*/*/metrics.csv; do echo "$f $(grep ',val,' $f | tail -1)"; done
