#!/usr/bin/env bash
# Issue 15's GPU speed tables on one GPU (scripts/gpu_issue15.py says what is measured):
#   10 model groups (RePa Tables 1/2 backbones, IFFN-Ti/S/B, AFBO Table 11 backbones) x
#   batch 128 and 1 x fp32 and bf16 autocast x eager and torch.compile  -> runs/gpu15/<setting>/<group>.json
# Usage (repo root of the GPU machine):
#   bash scripts/gpu_issue15.sh [SECONDS]     # a time budget, default 530 s (the device tool allows 600 per call)
# Call it again until it prints "80 of 80 runs finished": each call skips the runs already written
# and starts no new run after the budget (a run cut off by the hard timeout is lost, not half-written).
# The paper's setting (fp32, eager, batch 128) runs first, compiled runs last.
# Each call leaves $OUT/gpu15.tgz (or ./gpu15.tgz): every result JSON, env.json (GPU, driver, torch, CUDA,
# timm) and the log. On a fresh machine (a later lease) put that file at .gpu_state/gpu15.tgz and carry
# .gpu_state: finished runs are reused.
# Then, here: tar xzf gpu15.tgz; python scripts/gpu_table15.py runs/gpu15   (the markdown table)
# EXTRA replaces the measurement flags, e.g. a CPU dry run (tests/test_gpu_issue15.py does this):
#   EXTRA="--device cpu --img-size 32 --batches 1 --precisions fp32 --compile eager --warmup 0 --repeats 1" \
#     bash scripts/gpu_issue15.sh 60
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/.inductor     # graphs compiled in an earlier call are reused
budget=${1:-530}
python=${PYTHON:-python3}
mkdir -p runs
if [ -f .gpu_state/gpu15.tgz ] && [ ! -e runs/.gpu15_unpacked ]; then  # once per machine: an earlier lease's results
  tar xzf .gpu_state/gpu15.tgz
  touch runs/.gpu15_unpacked
fi
extra=${EXTRA:-"--device cuda"}
# the driver starts no run after budget - 120 s (the longest single run, ViT-L compiled, stays inside the budget);
# timeout is the hard stop
timeout -s INT -k 30 "$budget" $python scripts/gpu_issue15.py --out runs/gpu15 \
  --budget $((budget > 180 ? budget - 120 : budget / 2)) $extra 2>&1 | tee -a runs/gpu15.log | grep -v '^W[0-9]'
echo "gpu_issue15.py exit ${PIPESTATUS[0]}"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
$python scripts/gpu_table15.py runs/gpu15 > runs/gpu15/table.md && head -40 runs/gpu15/table.md
tar czf "${OUT:-.}/gpu15.tgz" runs/gpu15 runs/gpu15.log
ls -la "${OUT:-.}/gpu15.tgz"
