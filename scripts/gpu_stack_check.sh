#!/usr/bin/env bash
# Before a GPU job: run what scripts/gpu_job.sh runs under the GPU machine's Python stack, on this CPU.
# The GPU image has Python 3.12, torch 2.11.0, torchvision 0.26.0, timm 1.0.29, numpy 2.5.2 (device tool,
# KINDS.md) and no webdataset, cvxpy or grad-cam; our venv has Python 3.11 and torch 2.14.1. An API that
# only the newer torch has, or a top-level import of a package the image lacks, would fail there and
# cost the job, so this builds a venv of the image's versions (a CUDA build of torch from PyPI, about
# 5 GB; it runs on the CPU) and runs, in it:
#   1. tests/test_gpu_job.py: the whole GPU job with one-step budgets (Table 1, rechecks, GPU check, sweep);
#   2. three steps of two Table 1 rows per dataset with the job's settings (torch.compile, TF32, no
#      determinism, the job's compile_mode; without CUDA there are no CUDA graphs to capture);
#   3. the speed sweep's compiled runs (fp32 and bf16 autocast) of the DeiT-Ti group.
# Usage (repo root, shards under .gpu_data/{mnist,cifar10}): bash scripts/gpu_stack_check.sh [VENV]
# About 10-20 minutes on 2 cores once the venv exists (the compiles dominate). Each step prints "ok" or stops with its log's tail.
set -euo pipefail
venv=${1:-/tmp/gpuenv}
py312=  # PYTHON312, else the first Python 3.12 that runs (a pyenv shim without a 3.12 selected does not)
for c in ${PYTHON312:-python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12}; do
  "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { py312=$c; break; }
done
[ -n "$py312" ] || { echo "gpu_stack_check: no Python 3.12 runs here (${PYTHON312:+PYTHON312=$PYTHON312 is not one; }set PYTHON312)" >&2; exit 2; }
[ -d .gpu_data/mnist ] && [ -d .gpu_data/cifar10 ] || { echo "gpu_stack_check: .gpu_data/{mnist,cifar10} missing" >&2; exit 2; }
# (re)install unless the venv imports the image's torch and timm: an install cut short is completed
if ! "$venv/bin/python" -c 'import torch, timm, pytest; assert torch.__version__.startswith("2.11.0")' 2>/dev/null; then
  [ -x "$venv/bin/python" ] || "$py312" -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 timm==1.0.29 numpy==2.5.2 pyyaml safetensors \
    tensorboard matplotlib tqdm pytest pytest-timeout
fi
export PYTHONPATH=$PWD/src
. scripts/gpu_job_settings.sh  # T1_SETTINGS: the job's own Table 1 settings
py=$venv/bin/python
$py -c 'import torch, timm, sys; print("stack:", sys.version.split()[0], torch.__version__, timm.__version__)'
log=$(mktemp -d)
step() {  # name, command...
  local name=$1; shift
  if "$@" > "$log/$name.log" 2>&1; then echo "ok: $name"; else echo "FAILED: $name" >&2; tail -30 "$log/$name.log" >&2; exit 1; fi
}
step job-dry-run $py -m pytest -q -m slow tests/test_gpu_job.py -p no:cacheprovider
step table1-compiled $py -m vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --models ViT,NiNformer \
  --max-steps 3 --train-subset 512 --test-subset 256 --device cpu --data-root .gpu_data --output "$log/t1" \
  --threads 2 --set $T1_SETTINGS progress=log tensorboard=false
step sweep-compiled $py scripts/gpu_speed_sweep.py --device cpu --img-size 32 --batches 1 --precisions fp32,bf16 \
  --compile compile --warmup 1 --repeats 1 --groups deit_tiny --out "$log/gpu_speed"
echo "gpu_stack_check: all steps passed under the GPU image's versions (logs: $log)"
