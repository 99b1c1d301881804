#!/usr/bin/env bash
# Every GPU run of issue 10 at once on one GPU, 35 processes sharing it:
#   NiNformer Table 1, 8 runs (MNIST + CIFAR-10, 100 epochs, the corrected `ninformer` recipe, fp32) -> runs/gpu-t1
#   the CIFAR-10 blocks benchmark, 9 configurations x seeds 0,1,2 (20 epochs, `cifar10_blocks`)  -> runs/gpu-blocks
# The blocks benchmark is done (docs/results/cifar10_blocks, copied to runs/gpu-blocks and reused), so
# a call now trains the 8 Table 1 runs only. They take longer than one call: make the calls back to back
# on one warm machine (the device tool gives it back 30 s after a call, and a new machine has no
# checkpoints, so it starts unfinished runs over).
# Usage (repo root of the GPU machine; the shards copied to .gpu_data/{mnist,cifar10} and carried):
#   bash scripts/gpu_issue10.sh [SECONDS]     # a time budget, default 530 s (the device tool allows 600 per call)
# Call it again until it prints "35 of 35 runs finished". Each call resumes every unfinished run from its
# last.pth (written at each epoch end; a run stopped mid-epoch loses that epoch only) and reuses finished ones.
# Each call leaves $OUT/results.tgz (or ./results.tgz): config.yaml, metrics.csv, results.json, fold.json
# and the log of every run, no checkpoints. On a fresh machine (a later lease), put that file at
# .gpu_state/results.tgz and carry .gpu_state: finished runs are reused, unfinished ones start over (their
# checkpoints, ~32 MB each, do not fit the 8 x 16 MB the device tool returns).
# Then, here: tar xzf results.tgz; see docs/training.md ("Issue 10 on one GPU") for the table commands.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_COMPILE_THREADS=1                 # 35 compiling processes: no pool of 16 workers each
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/.inductor     # graphs compiled in an earlier call are reused
budget=${1:-530}
mkdir -p runs
# the blocks benchmark finished on an earlier lease (2026-11-23) and is committed: its runs are reused
if [ ! -e runs/gpu-blocks ] && [ -f docs/results/cifar10_blocks/summary.json ]; then
  mkdir -p runs/gpu-blocks && cp -r docs/results/cifar10_blocks/*/ runs/gpu-blocks/
fi
if [ -f .gpu_state/results.tgz ] && [ ! -e runs/.unpacked ]; then  # once per machine: an earlier lease's results
  tar xzf .gpu_state/results.tgz
  for d in runs/gpu-t1/*/*/ runs/gpu-blocks/*/*/; do  # unfinished runs lost their checkpoints: start them over
    [ -d "$d" ] && [ ! -f "$d/results.json" ] && rm -rf "$d"
  done
  touch runs/.unpacked
fi
(while sleep 60; do command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader; done) \
  >> runs/gpu_usage.log 2>&1 &
sampler=$!
# FAST replaces these flags, e.g. for a dry run on a CPU with tiny budgets (docs/training.md)
fast=${FAST:-"--device cuda --data-root .gpu_data --threads 1 --set compile=true compile_mode=reduce-overhead \
deterministic=false progress=log log_interval=200"}
timeout -s INT -k 90 $budget python3 -m vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --jobs 8 \
  --output runs/gpu-t1 $fast >> runs/gpu-t1.log 2>&1 &
t1=$!
timeout -s INT -k 90 $budget python3 -m vitblocks reproduce cifar10-blocks --jobs 27 --train-only \
  --output runs/gpu-blocks $fast >> runs/gpu-blocks.log 2>&1 &
blocks=$!
wait $t1; echo "ninformer-table1 exit $?"
wait $blocks; echo "cifar10-blocks exit $?"
kill $sampler
done_runs=$(ls runs/gpu-t1/*/*/results.json runs/gpu-blocks/*/*/results.json 2>/dev/null | wc -l)
echo "$done_runs of 35 runs finished"
tail -16 runs/gpu-t1.log
grep -h "seed .: top-1" runs/gpu-blocks.log | tail -27
for f in runs/gpu-t1/*/*/metrics.csv runs/gpu-blocks/*/*/metrics.csv; do
  [ -f "$f" ] && echo "$f $(grep ',val,' "$f" | tail -1)"
done
tail -3 runs/gpu_usage.log
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)"
tar czf "${OUT:-.}/results.tgz" --exclude='*.pth' --exclude='tensorboard' --exclude='.inductor' \
  --exclude='.unpacked' runs/gpu-t1 runs/gpu-blocks runs/gpu-t1.log runs/gpu-blocks.log runs/gpu_usage.log
ls -la "${OUT:-.}/results.tgz"
