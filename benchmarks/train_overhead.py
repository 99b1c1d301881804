"""Time per training step of vitblocks' training loop vs a bare PyTorch loop (same model, same batch).

Command (results: docs/training.md):

    .venv/bin/python benchmarks/train_overhead.py                         # NiNformer MNIST model, batch 32
    .venv/bin/python benchmarks/train_overhead.py --model vit_tiny_patch16_224 --input-size 3 32 32 \\
        --model-kwargs '{img_size: 32, patch_size: 4}' --batch-size 64

What is compared, on one fixed batch (data loading excluded from both; the loop's own batch
pipeline is timed separately below):

* ours: ``Trainer.train_step`` + ``Trainer.after_step`` -- the whole body of vitblocks' training
  loop: timm optimizer, the loss, the CPU NaN check (``loss.item()``), scheduler update, loss
  window, metrics row every ``log_interval`` steps, progress accounting; built from the
  ``ninformer`` recipe (Adam 1e-3, constant lr) so both loops do the same arithmetic;
* bare: ``opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()`` with
  ``torch.optim.Adam`` on an identical copy of the model.

The two run interleaved in rounds of ``--block`` steps (drift and other load on the machine hit
both alike), after ``--warmup`` untimed steps each; we report the median wall-clock ms per step
of each and the ratio ours / bare (target: <= 1.05). Models are in train mode with dropout, so
both draw the same kind of random numbers. Also reported: the tensor batch pipeline's time per
batch (slicing the uint8 dataset, flips, normalization), which a bare loop would spend too.
"""
import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.experiments import Trainer, load_recipe, merge
from vitblocks.profile import fixed_threads, interleaved_times

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests'))


def write_data(root: Path, size, n: int = 512) -> None:
    from _train_helpers import write_shards  # synthetic WebDataset shards, like ../shared/data
    c, h, _ = size
    write_shards(root, 'train', n=n, per_shard=n, size=h, channels=c, num_classes=10)
    write_shards(root, 'test', n=64, per_shard=64, size=h, channels=c, num_classes=10, seed=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', default='ninformer_vit_patch4_28')
    p.add_argument('--model-kwargs', default='{}', help='YAML mapping of timm kwargs')
    p.add_argument('--input-size', nargs=3, type=int, default=[1, 28, 28])
    p.add_argument('--batch-size', type=int, default=32)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--rounds', type=int, default=8)
    p.add_argument('--block', type=int, default=5, help='steps per loop per round')
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp, fixed_threads(args.threads) as threads:
        write_data(Path(tmp) / 'data', args.input_size)
        cfg = merge(load_recipe('ninformer'), dict(
            model=args.model, data=str(Path(tmp) / 'data'), batch_size=args.batch_size, progress='log',
            log_interval=50, tensorboard=False, output=str(Path(tmp) / 'runs'), name='bench', threads=args.threads,
            model_kwargs=yaml.safe_load(args.model_kwargs) or {}))
        trainer = Trainer(cfg)
        trainer.progress.mode = 'none'  # no stderr lines in the timed loop; the accounting still runs
        trainer.forward_model.train()
        trainer._loss_sum, trainer._loss_n = torch.zeros(()), 0
        x, y = next(trainer.train_loader.epoch(0))
        bare = copy.deepcopy(trainer.model).train()
        opt = torch.optim.Adam(bare.parameters(), lr=cfg.lr)

        def ours_step():
            trainer.after_step(trainer.train_step(x, y))

        def bare_step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(bare(x), y).backward()
            opt.step()

        times = interleaved_times({'ours': ours_step, 'bare': bare_step}, args.rounds, warmup=args.warmup,
                                  block=args.block)
        pipe = []
        batches = iter(trainer.train_loader.epoch(1))
        for _ in range(min(20, len(trainer.train_loader) - 1)):
            t0 = time.perf_counter()
            next(batches)
            pipe.append((time.perf_counter() - t0) * 1e3)

    med = {k: statistics.median(v) for k, v in times.items()}
    n = len(times['ours'])
    print(f'model {args.model}, batch {args.batch_size} x {"x".join(map(str, args.input_size))}, CPU, {threads} '
          f'thread(s), torch {torch.__version__}')
    print(f'{args.warmup} warm-up steps each, then {args.rounds} interleaved rounds of {args.block} steps: '
          f'{n} timed steps per loop; wall-clock ms per optimizer step')
    for k in ('ours', 'bare'):
        v = sorted(times[k])
        print(f'  {k:5s} median {med[k]:8.2f}   p10 {v[len(v) // 10]:8.2f}   p90 {v[(9 * len(v)) // 10]:8.2f}')
    print(f'  ratio ours / bare (medians): {med["ours"] / med["bare"]:.3f}  (target <= 1.05)')
    print(f'  tensor batch pipeline (slice uint8, flips, normalize): median {statistics.median(pipe):.3f} ms per batch')
    return 0


if __name__ == '__main__':
    sys.exit(main())
