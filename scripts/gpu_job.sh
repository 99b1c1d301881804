#!/usr/bin/env bash
# Run the evidence and speed suites inside a GPU job with a wall-clock limit (SLURM --time, a preemptible cloud
# instance), and resume in the next job from one state file. In priority order, as ONE background job:
#   0. beside the rest, the suite's CUDA cases (CUDA_TESTS; about 30 tests, minutes) -> runs/gpu-t1-cudatests.txt
#   1. NiNformer Table 1 in waves, the most telling runs first (T1_WAVES; compiled with CUDA graphs, fp32 with TF32
#      matmuls, under CUDA MPS where it starts, T1_MPS), each wave started only while T1_MIN of T1_TIME_LIMIT is
#      left and given what is left of it (rows committed finished under T1_SEED are reused, not retrained):
#        a. CIFAR-10's NiNformer row from PyTorch's default init, as the authors' script (block_cfg init=torch),
#           first, beside the row itself                                         -> runs/gpu-t1-torchinit
#        b. MNIST's MLP-Mixer and NiNformer rows                                 -> runs/gpu-t1
#        c. the CIFAR-10 ViT row with seeds 1 and 2 (VIT_SEEDS), its seed spread -> runs/gpu-t1-seed{1,2}
#        d. whatever else of Table 1 and these ablations is not finished (a fresh start: all of it)
#      then each row that diverged or missed the paper by more than a point, in full fp32, and each
#      diverged one also with clip_grad=1.0 (scripts/ninformer_table1_rechecks.py)  -> runs/gpu-t1-{fp32,clip}
#      then each run finished in this job evaluated through its training augmentation, as the
#      authors' script evaluates (vitblocks eval --train-augment 3)      -> RUN/eval_train_augment.json
#   2. the GPU check of the fused IFFN/AFBO kernels (benchmarks/gpu_check.py)      -> runs/gpu_check/
#   3. the speed sweep (scripts/gpu_speed_sweep.py), resuming the runs still valid -> runs/gpu_speed
# Why one background job: it runs in its own process session (setsid), so it outlives the call that started
# it. Each call of this script starts the job if none is alive, watches it for SECONDS (or until it ends),
# prints the progress and packs what is done into $OUT. Make the calls back to back: the next call finds the
# job still running, and no run restarts, loses an epoch or compiles again between calls.
#
# Usage (repo root of the GPU machine; MNIST and CIFAR-10 shards at .gpu_data/{mnist,cifar10}):
#   JOB_SECONDS=<seconds left> bash scripts/gpu_job.sh [SECONDS]   # SECONDS: default 560
# JOB_SECONDS (default 900) is what is left of the job's wall-clock limit when it starts; Table 1 gets that less
# 300 s. Repeat the call until "GPU job: done", the last call ending a minute before the time limit.
# Each call leaves ONE state file, $OUT/gpu_job_state.tgz (or ./): Table 1 and its rechecks (config, metrics,
# results and log of each run, no checkpoints), the speed sweep, the GPU check and gpu_job.log.
# To resume in the next job, put that file at .gpu_state/gpu_job_state.tgz (JOB_STATE): finished runs are
# reused; unfinished Table 1 runs start over (their checkpoints stay on the machine that made them).
# Dry run on a CPU (tests/test_gpu_job.py): T1_FLAGS, SWEEP_FLAGS and CHECK_FLAGS replace the GPU flags.
# Afterwards, here: docs/training.md ("Running the suites inside a GPU job with a time limit").
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_COMPILE_THREADS=2                 # 8 compiling processes on 16 cores
export TORCHINDUCTOR_CACHE_DIR=$PWD/runs/.inductor
python=${PYTHON:-python3}
. scripts/gpu_job_settings.sh                            # T1_SETTINGS
t1_flags=${T1_FLAGS:-"--device cuda --data-root .gpu_data --threads 2 --set $T1_SETTINGS progress=log log_interval=200"}
# what is left of the job's wall-clock limit at the first call (default 15 minutes)
job_seconds=${JOB_SECONDS:-900}
# Table 1 and its rechecks must end inside the job (their checkpoints do not outlive the machine): the runs that fit
# in T1_TIME_LIMIT seconds from the job's start finish, those projected to miss it are paused (reproduce
# --time-limit), and the rechecks run only if RECHECK_MIN seconds are left. The job's time less 300 s: the
# machine's start (1-2 min), the transfers, the evaluation of the finished runs and the last call's packing
t1_limit=${T1_TIME_LIMIT:-$((job_seconds - 300))}
# below T1_MIN seconds no Table 1 run can finish (one 100-epoch run alone, compiled: 4-6 min on an H100, by the
# pace of one run with eight sharing in fp32/TF32 and of one alone in bf16), so no wave starts with less left, and
# a job started with little time left goes straight to the speed measurements
t1_min=${T1_MIN:-400}
# the waves: 'DATASETS ROWS ABLATIONS [first]' separated by ';' (ROWS or ABLATIONS '-': all rows, none; 'first':
# --ablations-first). A 15-minute job fits about two runs, so each wave is a pair worth finishing together
t1_waves=${T1_WAVES:-"cifar10 NiNformer torchinit first; mnist MlpMixer,NiNformer -; cifar10 ViT seeds first;
                      mnist,cifar10 - torchinit,seeds"}
# finished runs committed from earlier jobs, reused instead of retrained (empty: none)
t1_seed=${T1_SEED-docs/results/ninformer_table1_h100}
vit_seeds=${VIT_SEEDS-1 2}                             # more seeds of the CIFAR-10 ViT row (empty: none)
recheck_min=${RECHECK_MIN:-300}
# the CUDA cases of the suite: the DDP stop vote, and every block deployed, under bf16, trained, compiled and
# benchmarked on the GPU (tests/test_on_device.py); their CPU cases are deselected
cuda_tests=${CUDA_TESTS:-"tests/test_scale.py tests/test_on_device.py -k cuda"}
sweep_flags=${SWEEP_FLAGS:-"--device cuda"}
check_flags=${CHECK_FLAGS:-"--device cuda"}  # CHECK_FLAGS=none: no GPU check
eval_flags=${EVAL_FLAGS:-"--device cuda"}

# CUDA MPS for Table 1 (T1_MPS=0: off). Without it the GPU gives each process's kernels their own time slices, so
# eight runs of these small models, each leaving most of the GPU idle, went no faster together than one alone
# (one NiNformer CIFAR-10 run alone: about 20k img/s; eight at once: about 3.2k img/s each, 25k in all). Under
# MPS their kernels run side by side. A machine where the daemon or a probe client fails goes on without it.
use_mps=${T1_MPS:-1}
mps_control=${MPS_CONTROL:-nvidia-cuda-mps-control}
mps_on=0

mps_start() {
  if [ "$use_mps" != 1 ]; then
    echo "$(date -u +%T) mps: off (T1_MPS=$use_mps)" >> runs/gpu_job.log; return
  fi
  if ! command -v "$mps_control" > /dev/null; then
    echo "$(date -u +%T) mps: not available (no $mps_control), the runs take turns on the GPU" >> runs/gpu_job.log
    return
  fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/vitblocks-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/vitblocks-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  # the probe: a CUDA client of the daemon (it starts the MPS server) that must compute within two minutes
  if "$mps_control" -d >> runs/gpu_job.log 2>&1 && timeout 120 $python -c 'import torch
assert float(torch.ones(4, device="cuda").sum()) == 4' >> runs/gpu_job.log 2>&1; then
    mps_on=1
    echo "$(date -u +%T) mps: on (the Table 1 runs share the GPU at once)" >> runs/gpu_job.log
  else
    mps_stop
    echo "$(date -u +%T) mps: failed its probe (above), off: the runs take turns on the GPU" >> runs/gpu_job.log
  fi
}

mps_stop() {  # before the speed measurements, which each want the GPU to themselves
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then
    echo quit | timeout 60 "$mps_control" >> runs/gpu_job.log 2>&1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    [ "$mps_on" = 1 ] && echo "$(date -u +%T) mps: stopped" >> runs/gpu_job.log
    mps_on=0
  fi
}

read_waves() { IFS=';' read -ra waves <<< "$(echo $t1_waves)"; }  # -> waves, one 'DATASETS ROWS ...' each

check_waves() {  # T1_WAVES, read before any job starts: a wrong one is the call's error, not a lost job
  local wave
  read_waves
  for wave in "${waves[@]}"; do
    set -- $wave
    if [ $# -lt 3 ] || [ $# -gt 4 ] || { [ $# = 4 ] && [ "$4" != first ]; } || \
       ! [[ ",$3," =~ ^(,(torchinit|seeds))+,$ || "$3" = - ]]; then
      echo "T1_WAVES: '$wave' is not 'DATASETS ROWS ABLATIONS [first]' (ROWS: comma-separated rows or -;" \
        "ABLATIONS: torchinit and/or seeds, comma-separated, or -)" >&2
      return 2
    fi
  done
}

job() {  # the background job: each step in turn, whatever the one before it left
  t1_end=$(( $(date +%s) + t1_limit ))
  [ "$t1_limit" -ge "$t1_min" ] && mps_start  # before any CUDA client (a late machine trains nothing)
  # the suite's CUDA cases (skipped on a CPU), beside everything else                 -> runs/gpu-t1-cudatests.txt
  # niced: its compilations give way to Table 1's processes on the CPU
  ( nice -n 10 $python -m pytest -q -p no:cacheprovider -rs $cuda_tests > runs/gpu-t1-cudatests.txt 2>&1 < /dev/null
    echo "$(date -u +%T) cuda tests exit $?" >> runs/gpu_job.log ) &
  if [ "$t1_limit" -lt "$t1_min" ]; then
    echo "$(date -u +%T) table1 skipped: T1_TIME_LIMIT ${t1_limit} s < T1_MIN ${t1_min} s" >> runs/gpu_job.log
    : > runs/gpu-t1-rechecks.txt
  else
    worst=0
    read_waves
    for i in "${!waves[@]}"; do
      set -- ${waves[$i]}
      left=$(( t1_end - $(date +%s) ))
      if [ "$left" -lt "$t1_min" ]; then
        echo "$(date -u +%T) table1 wave $((i + 1)) ($*) not started: ${left} s left < T1_MIN ${t1_min} s" >> runs/gpu_job.log
        continue
      fi
      ablations=()
      for name in ${3//,/ }; do
        case $name in
          # the init ablation: NiNformer's CIFAR-10 row, which plateaus near 75% (paper 81.59) with timm's init
          torchinit) ablations+=(--ablation torchinit cifar10/NiNformer "model_kwargs={block_cfg: {init: torch}}") ;;
          # the seed spread of the CIFAR-10 ViT row (seed 0: 64.07 at epoch 100, 61.23-64.95 over its last 20
          # epochs; paper 65.74): the same run with seeds 1 and 2
          seeds) for seed in $vit_seeds; do ablations+=(--ablation "seed$seed" cifar10/ViT "seed=$seed"); done ;;
        esac
      done
      rows=(); [ "$2" != - ] && rows=(--models "$2")
      first=(); [ "${4:-}" = first ] && [ ${#ablations[@]} -gt 0 ] && first=(--ablations-first)
      # one pool: the wave's rows still owed and its ablations share the GPU; under the time limit the ablations
      # are paused first (last with 'first'), then the baselines, NiNformer's own rows last
      $python -m vitblocks reproduce ninformer-table1 --datasets "$1" "${rows[@]}" --jobs 8 --output runs/gpu-t1 \
        --time-limit "$left" $t1_flags "${ablations[@]}" "${first[@]}" >> runs/gpu-t1.log 2>&1
      rc=$?  # (a command substitution in the echo below would reset $?)
      echo "$(date -u +%T) table1 wave $((i + 1)) ($*) exit $rc" >> runs/gpu_job.log
      [ "$rc" -gt "$worst" ] && worst=$rc
    done
    echo "$(date -u +%T) table1 exit $worst" >> runs/gpu_job.log
    $python scripts/ninformer_table1_rechecks.py runs/gpu-t1 > runs/gpu-t1-rechecks.txt 2>> runs/gpu_job.log
  fi
  # 1b. each row that diverged or ended more than a point below the paper, again in full fp32 (TF32 off),
  # and each diverged one also with gradient clipping: all at once, each to its own log, inside what is
  # left of Table 1's time limit (a recheck that cannot finish pauses and leaves the GPU to the rest)
  left=$(( t1_end - $(date +%s) ))
  if [ "$left" -lt "$recheck_min" ]; then
    echo "$(date -u +%T) rechecks: $(wc -l < runs/gpu-t1-rechecks.txt) row(s) listed, not rerun:" \
      "${left} s left" >> runs/gpu_job.log
    : > runs/gpu-t1-rechecks.txt
  fi
  while read -r ds model why; do
    for ablation in "fp32 matmul_precision=highest" "clip clip_grad=1.0"; do
      set -- $ablation
      [ "$1" = clip ] && [ "$why" != diverged ] && continue
      mkdir -p "runs/gpu-t1-$1/$ds"
      $python -m vitblocks reproduce ninformer-table1 --datasets "$ds" --models "$model" --output "runs/gpu-t1-$1" \
        --time-limit "$left" $t1_flags "$2" >> "runs/gpu-t1-$1/$ds/$model.log" 2>&1 < /dev/null &
    done
  done < runs/gpu-t1-rechecks.txt
  wait  # the rechecks: nothing trains while the sweep measures speed
  echo "$(date -u +%T) rechecks: $(wc -l < runs/gpu-t1-rechecks.txt) row(s) rerun" >> runs/gpu_job.log
  # 1c. the authors' script measures test accuracy through its training augmentation (random crops and flips):
  # each run that finished in this job (its last.pth is on this machine) is also evaluated that way, 3 passes
  n=0
  for ckpt in runs/gpu-t1*/*/*/last.pth; do
    d=${ckpt%/last.pth}
    [ -f "$d/results.json" ] && [ ! -s "$d/eval_train_augment.json" ] || continue
    data=$(sed -n 's/^data: //p' "$d/config.yaml")
    $python -m vitblocks eval --checkpoint "$ckpt" --data "$data" --train-augment 3 --progress none $eval_flags \
      --json "$d/eval_train_augment.json" > "$d/eval_train_augment.txt" 2>&1 < /dev/null &
    n=$((n + 1))
  done
  wait
  echo "$(date -u +%T) evaluated $n run(s) through the training augmentation" >> runs/gpu_job.log
  mps_stop
  if [ "$check_flags" != none ]; then  # resumes: the steps whose files exist are skipped
    $python benchmarks/gpu_check.py --out runs/gpu_check $check_flags >> runs/gpu_check.log 2>&1
    rc=$?
    echo "$(date -u +%T) GPU check exit $rc" >> runs/gpu_job.log
  fi
  $python scripts/gpu_speed_sweep.py --out runs/gpu_speed $sweep_flags >> runs/gpu_speed.log 2>&1
  rc=$?
  if [ $rc = 2 ] && tail -1 runs/gpu_speed.log | grep -q 'holds runs measured on another setup'; then
    # another GPU, driver or torch than the committed runs': all 80 runs afresh, none mixed in
    mv runs/gpu_speed runs/gpu_speed-other-setup
    $python scripts/gpu_speed_sweep.py --out runs/gpu_speed $sweep_flags >> runs/gpu_speed.log 2>&1
    rc=$?
  fi
  echo "$(date -u +%T) sweep exit $rc" >> runs/gpu_job.log
  $python scripts/gpu_speed_table.py runs/gpu_speed > runs/gpu_speed/table.md 2>> runs/gpu_job.log
  touch runs/gpu_job.done
}
if [ "${1:-}" = "--job" ]; then job; exit 0; fi

budget=${1:-560}
state=${JOB_STATE:-.gpu_state/gpu_job_state.tgz}  # the state file an earlier job left in its $OUT
check_waves || exit 2
mkdir -p runs
if [ ! -e runs/.gpu_job_unpacked ]; then  # once per machine: an earlier job's state, else the committed runs
  if [ -f "$state" ]; then
    # its Table 1 runs and its sweep (not its GPU check, whose steps this machine measures again)
    tar xzf "$state" --exclude='runs/gpu_check*' --exclude=runs/gpu_job.log
    for d in runs/gpu-t1*/*/*/; do  # unfinished runs lost their checkpoints with their machine: start them over
      [ -d "$d" ] && [ ! -f "$d/results.json" ] && rm -rf "$d"
    done
    echo "$(date -u +%T) resumed from $state" >> runs/gpu_job.log
  elif [ -n "$t1_seed" ] && [ -d "$t1_seed" ]; then
    # the committed finished runs (config, metrics, results: all a reuse reads) of Table 1, of the init
    # ablation (${t1_seed}_torchinit) and of the ViT seeds (${t1_seed}_seedN), each where its command writes
    pairs="$t1_seed:runs/gpu-t1 ${t1_seed}_torchinit:runs/gpu-t1-torchinit"
    for seed in $vit_seeds; do pairs="$pairs ${t1_seed}_seed$seed:runs/gpu-t1-seed$seed"; done
    for pair in $pairs; do
      src=${pair%%:*}; dst=${pair#*:}
      for f in "$src"/*/*/results.json; do
        [ -f "$f" ] || continue
        d=${f%/results.json}; run=$dst/${d#"$src"/}
        mkdir -p "$run" && cp "$d/config.yaml" "$d/metrics.csv" "$d/results.json" "$run/"
        echo "$(date -u +%T) reused committed run $run" >> runs/gpu_job.log
      done
    done
  fi
  if [ -f docs/results/gpu_speed_h100/env.json ] && [ ! -e runs/gpu_speed ]; then
    # the committed sweep, without the groups measured before IFFN/AFBO took their GPU path (docs/gpu_speed.md);
    # scripts/gpu_speed_sweep.py refuses all of it if this machine's GPU, driver or torch differ
    mkdir -p runs/gpu_speed && cp -r docs/results/gpu_speed_h100/. runs/gpu_speed/
    rm -f runs/gpu_speed/*/deit_*.json runs/gpu_speed/*/swin_tiny.json runs/gpu_speed/*/poolformer_s12.json \
      runs/gpu_speed/*/poolformer_s24.json runs/gpu_speed/table.md runs/gpu_speed/sweep.log
  fi
  touch runs/.gpu_job_unpacked
fi
[ "${1:-}" = "--unpack-only" ] && exit 0  # (tests)

alive() { [ -f runs/gpu_job.pid ] && kill -0 "$(cat runs/gpu_job.pid)" 2> /dev/null; }
if alive; then
  echo "GPU job running (pid $(cat runs/gpu_job.pid)), watching it"
elif [ -e runs/gpu_job.done ]; then
  echo "GPU job finished in an earlier call"
else
  # a forked child leads a new process session (what setsid(1) does; Python is there whatever the image
  # has), writes its pid to runs/gpu_job.pid and becomes the job. It runs a copy of this script: the
  # working tree may be copied again at each call, and bash reads a script as it goes
  cp scripts/gpu_job.sh runs/.gpu_job_copy.sh
  $python -c 'import os, sys
if os.fork():
    sys.exit(0)
os.setsid()
open("runs/gpu_job.pid", "w").write(str(os.getpid()))
os.execvp("bash", ["bash", "runs/.gpu_job_copy.sh", "--job"])' < /dev/null > /dev/null 2>&1
  sleep 2
  echo "$(date -u +%T) GPU job started (pid $(cat runs/gpu_job.pid))" | tee -a runs/gpu_job.log
fi

end=$((SECONDS + budget))
while alive && [ $SECONDS -lt $end ]; do
  sleep 5
  [ $((SECONDS % 120)) -lt 5 ] && command -v nvidia-smi > /dev/null && \
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader >> runs/gpu_usage.log
done

finished=$(ls runs/gpu-t1/*/*/results.json 2> /dev/null | wc -l)
echo "Table 1: $finished of 8 runs finished"
if [ -f runs/gpu-t1-rechecks.txt ]; then
  echo "rechecks ($(ls runs/gpu-t1-{fp32,clip}/*/*/results.json 2> /dev/null | wc -l) ablation runs finished):"
  cat runs/gpu-t1-rechecks.txt
fi
for f in runs/gpu-t1*/*/*/metrics.csv; do  # Table 1 and its rechecks: last test row, ETA, why it stopped
  [ -f "$f" ] || continue
  d=${f%/metrics.csv}
  echo "$f $(grep ',val,' "$f" | tail -1) | $(grep -o 'epoch [0-9.]* .*ETA [0-9:?]*' "$d.log" 2> /dev/null | tail -1)"
  [ -f "$d/stopped.json" ] && echo "  stopped: $(tr -d '\n' < "$d/stopped.json" | cut -c1-300)"
done
grep -h '^pausing\|^paused\|^resumed\|^killed' runs/gpu-t1.log 2> /dev/null  # what --time-limit did
tail -1 runs/gpu-t1.log 2> /dev/null
echo "sweep: $(ls runs/gpu_speed/*/*.json 2> /dev/null | wc -l) of 80 runs written"
tail -4 runs/gpu_speed.log 2> /dev/null
cat runs/gpu_job.log
tail -2 runs/gpu_usage.log 2> /dev/null
{ command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $python -c "import torch, timm; print('torch', torch.__version__, 'timm', timm.__version__)"
} > runs/gpu-t1-env.txt 2> /dev/null  # for the tables' headers (scripts/collect_job_results.py)
cat runs/gpu-t1-env.txt
out=${OUT:-.}
# the one state file: Table 1 and its rechecks (no checkpoints), the sweep, the GPU check and the job's log
tar czf "$out/gpu_job_state.tgz" --exclude='*.pth' --exclude='tensorboard' runs/gpu-t1* runs/gpu_speed \
  runs/gpu_speed.log runs/gpu_check runs/gpu_check.log runs/gpu_job.log 2> /dev/null
if [ -e runs/gpu_job.done ]; then echo "GPU job: done"; else echo "GPU job: still running; call again at once"; fi
