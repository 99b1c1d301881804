#!/usr/bin/env bash
# Probe: how fast do the NiNformer Table 1 runs go on a GPU, alone and 8 at once? (device tool)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -c "import torch,timm;print('torch',torch.__version__,'timm',timm.__version__,torch.cuda.get_device_name())"
nproc
t=$(date +%s)
python3 -m vitblocks reproduce ninformer-table1 --datasets cifar10 --models ninformer_vit_patch4_32 --epochs 2 \
  --data-root .gpu_data --output $PWD/probe_alone --device cuda 2>&1 | tail -4
echo "alone 2 epochs: $(( $(date +%s) - t )) s"
t=$(date +%s)
python3 -m vitblocks reproduce ninformer-table1 --datasets mnist,cifar10 --epochs 2 --jobs 8 \
  --data-root .gpu_data --output $PWD/probe8 --device cuda 2>&1 | tail -12
echo "8 jobs 2 epochs: $(( $(date +%s) - t )) s"
grep -h "" probe_alone/*/*/metrics.csv probe8/cifar10/ninformer_vit_patch4_32/metrics.csv
tail -3 probe8/*/*.log
