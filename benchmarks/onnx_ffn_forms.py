"""How one deployed FFN is best written for ONNX Runtime: each candidate graph of the same layer, exported and
timed in ONNX Runtime against timm's Mlp on the input the layer really gets, interleaved (CPU).

Command (results and discussion: docs/cpu_deploy.md):

    .venv/bin/python benchmarks/onnx_ffn_forms.py                          # AFBO of DeiT-T and IFFN of DeiT-S, batch 16
    .venv/bin/python benchmarks/onnx_ffn_forms.py --block afbo --profile   # + ONNX Runtime's slowest ops per form

The forms (each checked equal to the eager layer in ONNX Runtime before it is timed):

* ``reference``: the layer's reference ops as torch exports them (what exported files held before): AFBO's
  maps as gathers and batched matmuls between transposes, the depthwise convs channels-first between transposes;
* ``grouped, channels-first`` (AFBO): every map as a matmul per group on channels-first features, so the
  depthwise convs need no transpose (the input is transposed once, ``d`` wide) and fc2 reads them transposed;
* ``export``: what ``torch.export`` / ``torch.onnx.export`` record from the deployed layer now
  (``IFFNDeployed._forward_export``, ``AFBODeployed._forward_export``): channels-last, the conv's layout changes
  right around it (ONNX Runtime folds them into its conv's reorders), AFBO's maps as dense matmuls.

Weights are random (speed does not depend on their values). Median ms per call over ``--repeats`` interleaved
calls (``vitblocks.profile.interleaved_times``) in sessions set up as ``benchmarks/cpu_runtimes.py`` sets them up;
the ratio is against timm's Mlp of the same widths.
"""
import argparse
import contextlib
import io
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import timm
import torch
from timm.layers import Mlp
from torch import nn

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.deploy import reparameterize
from vitblocks.profile import input_size_of, interleaved_times

sys.path.insert(0, str(Path(__file__).parent))
import iffn_latency  # noqa: E402
from _cpu_runtimes import OnnxRuntime, op_profile  # noqa: E402

BLOCKS = {'afbo': 'afbo_deit_tiny_patch16_224', 'iffn': 'iffn_deit_small_patch16_224'}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--block', choices=[*BLOCKS, 'both'], default='both')
    p.add_argument('--batch-size', type=int, default=16)
    p.add_argument('--threads', type=int, default=2, help='ONNX Runtime intra-op threads (default 2)')
    p.add_argument('--repeats', type=int, default=20, help='timed calls per form (default 20)')
    p.add_argument('--profile', action='store_true', help="print ONNX Runtime's slowest ops of each form")
    return p.parse_args(argv)


class Reference(nn.Module):
    """The layer's reference ops (``_forward_reference``), as an export records them."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer._forward_reference(x)


class GroupedChannelsFirst(nn.Module):
    """AFBO with each channel map as one matmul per group on channels-first ``(B, d, N)`` features."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def _map(self, m, x_cf):  # (B, d, N) -> (B, Md, N)
        batch, _, n = x_cf.shape
        w = m.bmm_weight().transpose(1, 2)  # (G, K, n) -> (G, n, K)
        xg = x_cf.index_select(1, m.input_channels().flatten())  # (B, G*K, N): each group's input channels
        y = torch.matmul(w, xg.reshape(batch, w.shape[0], -1, n)).flatten(1, 2)  # (B, G, n, N) -> (B, Md, N)
        return y + m.bias.view(-1, 1)

    def _spatial(self, conv, y):  # (B, Md, N) -> (B, Md, N), prefix tokens passing by
        batch, c, _ = y.shape
        p, (gh, gw) = self.layer.layout.num_prefix_tokens, self.layer.layout.grid_size
        z = conv(y[:, :, p:].reshape(batch, c, gh, gw)).flatten(2)  # (B, Md, H*W) -> (B, Md, H, W) -> back
        return torch.cat([y[:, :, :p], z], dim=2) if p else z

    def forward(self, x):  # tokens (B, N, d)
        f = self.layer
        x_cf = x.transpose(1, 2)  # (B, N, d) -> (B, d, N)
        left = self._spatial(f.left_spatial, self._map(f.left_map, x_cf))
        right = self._spatial(f.right_spatial, self._map(f.right_map, x_cf))
        z = f._combine(left, right)  # (B, Md, N)
        return torch.matmul(z.transpose(1, 2), f.fc2.weight.t()) + f.fc2.bias  # (B, N, Md) @ (Md, d)


def first_ffn_and_input(name: str, batch_size: int):
    """The deployed model's first FFN and the batch it receives in a real forward (iffn_latency's helper)."""
    model = reparameterize(timm.create_model(name))
    _, layer, x = iffn_latency.first_ffn_and_input(model, batch_size, input_size_of(model))
    return layer, x


def export_form(module: nn.Module, x: torch.Tensor, path: Path) -> Path:
    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(module, (x,), path, dynamo=True, input_names=['input'], output_names=['output'])
    return path


def compare(block: str, args) -> None:
    layer, x = first_ffn_and_input(BLOCKS[block], args.batch_size)
    forms = {'timm Mlp': Mlp(x.shape[-1], layer.hidden_features).eval(), 'reference': Reference(layer)}
    if block == 'afbo':
        forms['grouped, channels-first'] = GroupedChannelsFirst(layer)
    forms['export'] = layer
    with torch.no_grad():
        expected = layer(x).numpy()
    feed = {'input': x.numpy()}
    runtime = OnnxRuntime(args.threads)  # the session settings of benchmarks/cpu_runtimes.py
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {n: runtime.session(export_form(m, x, Path(tmp) / f'form{i}.onnx'),
                                       Path(tmp) / f'profile{i}' if args.profile else None)
                    for i, (n, m) in enumerate(forms.items())}
        for name, sess in sessions.items():
            if name != 'timm Mlp':
                err = float(np.abs(sess.run(None, feed)[0] - expected).max())
                if not err < 1e-4:
                    raise SystemExit(f'{block} form {name!r} computes other outputs in ONNX Runtime (max error {err})')
        times = interleaved_times({n: (lambda s=s: s.run(None, feed)) for n, s in sessions.items()}, args.repeats)
        base = statistics.median(times['timm Mlp'])
        print(f'\n{block}: first FFN of {BLOCKS[block]}, input {tuple(x.shape)}, ONNX Runtime, {args.threads} threads')
        print(f'  {"form":26s} {"median ms":>10s} {"vs Mlp":>8s}')
        for n in sessions:
            med = statistics.median(times[n])
            print(f'  {n:26s} {med:10.2f} {med / base:7.2f}x')
        if args.profile:
            for n, sess in sessions.items():
                untimed = 1 if n == 'timm Mlp' else 2  # the output check and the warm-up round
                print(f'  slowest ops, {n}:')
                for node in op_profile(Path(sess.end_profiling()), untimed)['nodes'][:8]:
                    print(f'    {node["op"]:22s} {node["name"][:44]:44s} {100 * node["share"]:5.1f}% '
                          f'{node["ms_per_run"]:8.2f} ms')
        runtime.close()


def main(argv=None):
    args = parse_args(argv)
    import onnxruntime as ort
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f'{platform.processor() or platform.machine()}, torch {torch.__version__} '
          f'({torch.backends.cpu.get_cpu_capability()}), onnxruntime {ort.__version__}')
    for block in (BLOCKS if args.block == 'both' else [args.block]):
        compare(block, args)


if __name__ == '__main__':
    main()
