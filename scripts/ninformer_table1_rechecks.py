"""The NiNformer Table 1 runs that need an ablation, one line each: ``<dataset> <model> <why>``.

    python scripts/ninformer_table1_rechecks.py runs/gpu-t1 [--margin 1.0]

Listed: runs that stopped on a non-finite loss ("diverged": their stopped.json says so, or, for runs
made before that record, their log) and finished runs more than --margin points below the paper.
scripts/gpu_job.sh reruns each in full fp32 (TF32 off) and each diverged one also with gradient
clipping, so a row that misses the paper comes back with the ablations that explain it.
"""
import argparse
from pathlib import Path

from vitblocks.data import DataError
from vitblocks.reproduce.ninformer_table1 import NINFORMER_DATASETS, ninformer_rechecks

p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
p.add_argument('output', help='the --output folder of `vitblocks reproduce ninformer-table1`')
p.add_argument('--datasets', default='mnist,cifar10', help=f'comma-separated, of {", ".join(NINFORMER_DATASETS)}')
p.add_argument('--margin', type=float, default=1.0, help='points below the paper that call for a recheck')
args = p.parse_args()
if not Path(args.output).is_dir():  # else a mistyped folder would read as "nothing to recheck"
    p.error(f'{args.output}: no such folder')
try:
    rechecks = ninformer_rechecks(args.output, args.datasets.split(','), args.margin)
except DataError as e:  # an unknown dataset
    p.error(str(e))
for ds, model, why in rechecks:
    print(ds, model, why)
