#!/usr/bin/env bash
# Which training setting runs the NiNformer-paper models fastest on a GPU? 2 epochs each, alone,
# NiNformer on CIFAR-10 (data under .gpu_data/cifar10). Results: docs/training.md, "The full protocol".
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
v() {  # name, extra overrides
  name=$1; shift
  python3 -m vitblocks train --model ninformer_vit_patch4_32 --data .gpu_data/cifar10 --config ninformer --epochs 2 \
    --output $PWD/var --name $name progress=none "$@" > var_$name.log 2>&1 || tail -20 var_$name.log
  python3 - $name <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(f'var/{sys.argv[1]}/metrics.csv')) if r['split'] == 'val']
t = [float(r['elapsed_s']) for r in rows]
print(f'{sys.argv[1]:24s} epoch1 {t[0]:6.1f} s  epoch2 {t[1]-t[0]:6.1f} s  top1 {rows[-1]["top1"]}')
PY
}
v eager_det
v eager_nodet deterministic=false
v compile compile=true deterministic=false
v compile_ro compile=true compile_mode=reduce-overhead deterministic=false
