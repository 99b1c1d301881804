"""Single-op timings behind the IFFN inference path (docs/iffn_speed.md, "what did not help").

Command:

    .venv/bin/python benchmarks/iffn_ops.py [--threads N] [--steady-malloc] [--compile]

Times, on the tensors one IFFN block of iffn_deit_small sees at batch 32 (B=32, N=196 tokens,
C=384, C'=4C=1536; a C'-wide fp32 tensor is 38.5 MB), the ops the design choices hinge on:
fc1 at 2C vs 4C outputs (folding AGeLU's alpha/gamma into fc1 needs the 4C one), out-of-place vs
in-place element-wise ops (a fresh 38.5 MB tensor vs reusing one), the depthwise conv on the
channels-last view of the tokens vs on a channels-first copy, and the copy it would take; with
``--compile`` also the exact GELU compiled by inductor, as torch writes it (erf) and as
``gelu_rational`` (the form IFFN's compiled inference path uses, layers/rational_gelu.py).
Median wall-clock ms per call over --repeats, the ops interleaved round by round.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _ratio_runs import add_malloc_option, apply_malloc_option  # noqa: E402

from vitblocks.layers.rational_gelu import gelu_rational  # noqa: E402
from vitblocks.profile import interleaved_times  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--threads', type=int, help="torch intra-op threads (default: torch's default)")
    p.add_argument('--repeats', type=int, default=15)
    p.add_argument('--compile', action='store_true', help='also time the GELU compiled by inductor, erf and rational')
    add_malloc_option(p, '--glibc-no-mmap')  # the old name of the option
    args = p.parse_args(argv)
    allocator = apply_malloc_option(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, H, W, C = 32, 14, 14, 384
    hid = 4 * C
    x = torch.randn(B, H * W, C)
    w1, b1 = torch.randn(hid // 2, C) * .02, torch.zeros(hid // 2)
    w1_wide, b1_wide = torch.randn(hid, C) * .02, torch.zeros(hid)
    w2, b2 = torch.randn(C, hid) * .02, torch.zeros(C)
    alpha, gamma, beta, theta = (torch.rand(2, hid // 2) + .5 for _ in range(4))
    h = F.linear(x, w1, b1)  # (B, N, 2C)
    h_wide = F.linear(x, w1_wide, b1_wide).view(B, H * W, 2, hid // 2)  # alpha/gamma already applied
    y = torch.randn(B, H * W, hid)
    fmap = y.view(B, H, W, hid).permute(0, 3, 1, 2)  # channels-last view (B, C', H, W)
    fmap_cf = fmap.contiguous()  # channels-first copy
    ln_w, ln_b = torch.rand(hid), torch.randn(hid)
    conv = torch.nn.Conv2d(hid, hid, 3, padding=1, groups=hid)

    def agelu_out_of_place():  # training form: three fresh C'-wide tensors
        u = torch.addcmul(gamma, alpha, h.unsqueeze(-2))
        return torch.addcmul(theta, beta, F.gelu(u))

    def agelu_in_place():  # deployed: one fresh tensor, finished in place
        u = torch.addcmul(gamma, alpha, h.unsqueeze(-2))
        torch.ops.aten.gelu_(u)
        return torch.addcmul(theta, beta, u, out=u)

    def agelu_after_wide_fc1():  # what is left when alpha/gamma live in a 4C-wide fc1
        u = torch.ops.aten.gelu_(h_wide)
        return torch.addcmul(theta, beta, u, out=u)

    ops = {
        'fc1 C->2C (IFFN)': lambda: F.linear(x, w1, b1),
        'fc1 C->4C (alpha/gamma folded)': lambda: F.linear(x, w1_wide, b1_wide),
        'fc2 4C->C': lambda: F.linear(y, w2, b2),
        'AGeLU x2, out of place': agelu_out_of_place,
        'AGeLU x2, in place': agelu_in_place,
        'AGeLU x2 after 4C fc1, in place': agelu_after_wide_fc1,
        'GELU 4C, out of place': lambda: F.gelu(y),
        'GELU 4C, in place': lambda: torch.ops.aten.gelu_(y),
        'add 4C, out of place': lambda: y + y,
        'add 4C, in place': lambda: y.add_(0.0),
        'LayerNorm 4C': lambda: F.layer_norm(y, (hid,), ln_w, ln_b),
        'BatchNorm (eval) 4C': lambda: F.batch_norm(fmap, torch.zeros(hid), torch.ones(hid), ln_w, ln_b, False),
        'dw conv 3x3, channels-last view': lambda: conv(fmap),
        'dw conv 3x3, channels-first copy': lambda: conv(fmap_cf),
        'tokens -> channels-first copy': lambda: fmap.contiguous(),
        'copy 4C (clone)': lambda: y.clone(),
    }
    if args.compile:
        gelu_erf, gelu_rat = torch.compile(F.gelu), torch.compile(gelu_rational)
        ops['GELU 4C, torch.compile(F.gelu)'] = lambda: gelu_erf(y)
        ops['GELU 4C, torch.compile(gelu_rational)'] = lambda: gelu_rat(y)
    with torch.inference_mode():
        times = interleaved_times(ops, args.repeats)
    print(f'{torch.get_num_threads()} threads, {allocator}; '
          f'B={B} N={H * W} C={C}; median ms per call over {args.repeats}')
    width = max(map(len, ops))
    for k, v in times.items():
        print(f'{k:{width}s}  {statistics.median(v):8.2f} ms')


if __name__ == '__main__':
    main()
