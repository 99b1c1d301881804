"""Where a training step's CPU time goes, by ATen op: torch.profiler self CPU time of whole steps.

Command (results: docs/training.md, "One epoch on this CPU"):

    .venv/bin/python benchmarks/train_step_ops.py                        # NiNformer CIFAR model, dropout 0.5
    .venv/bin/python benchmarks/train_step_ops.py --mlp-drop 0           # the same without dropout

One fixed random batch, Adam, cross-entropy; the model in train mode with the ``ninformer`` recipe's
dropout in every MLP (``mlp_drop``, as ``vitblocks.experiments.setup.mlp_dropout_kwargs`` places it).
After one untimed step, each of ``--steps`` steps is profiled on its own, and for each the share of the
step's self CPU time of the dropout masks (``aten::bernoulli_``), of the GEMMs (``aten::mm`` +
``aten::addmm``) and of the element-wise products (``aten::mul``) is printed, then the top ops of the
last step. Shares within one step move less with the load on a shared machine than absolute times.
"""
import argparse

import timm
import torch
import torch.nn.functional as F
from torch.profiler import profile

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.experiments.setup import mlp_dropout_kwargs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--model', default='ninformer_vit_patch4_32')
    p.add_argument('--input-size', type=int, nargs=3, default=[3, 32, 32], metavar=('C', 'H', 'W'))
    p.add_argument('--batch-size', type=int, default=128)
    p.add_argument('--mlp-drop', type=float, default=0.5, help='dropout in every MLP (the ninformer recipe: 0.5)')
    p.add_argument('--steps', type=int, default=3)
    p.add_argument('--threads', type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    drop = mlp_dropout_kwargs(args.model, args.mlp_drop) if args.mlp_drop else {}
    model = timm.create_model(args.model, num_classes=10, **drop).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch_size, *args.input_size), torch.randint(0, 10, (args.batch_size,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # untimed: first-call allocations
    print(f'{args.model}, batch {args.batch_size}, mlp_drop {args.mlp_drop}, {args.threads} thread(s), '
          f'torch {torch.__version__}: share of each step\'s self CPU time')
    for i in range(args.steps):
        with profile() as prof:
            step()
        self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
        total = sum(self_us.values())
        share = lambda *ops: sum(self_us.get(op, 0) for op in ops) / total  # noqa: E731
        print(f'step {i + 1}: {total / 1e6:.2f} s; dropout masks (bernoulli_) {share("aten::bernoulli_"):.1%}, '
              f'GEMMs (mm + addmm) {share("aten::mm", "aten::addmm"):.1%}, mul {share("aten::mul"):.1%}')
    print(prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=10))


if __name__ == '__main__':
    main()
