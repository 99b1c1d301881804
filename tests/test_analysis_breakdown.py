"""Latency per component (RePa Fig. 3): components cover the forward and sum to its measured time."""
import timm
import torch

from vitblocks.analysis import latency_breakdown
from vitblocks.analysis.components import component_modules


def test_components_are_found_once_per_family():
    vit = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=2, embed_dim=16, num_heads=2)
    names = \
        {n: c for n, c, _ in component_modules(vit)}
    assert names == {'patch_embed': 'patch embed', 'blocks.0.norm1': 'norm', 'blocks.0.attn': 'token mixer',
                     'blocks.0.norm2': 'norm', 'blocks.0.mlp': 'ffn', 'blocks.1.norm1': 'norm',
                     'blocks.1.attn': 'token mixer', 'blocks.1.norm2': 'norm', 'blocks.1.mlp': 'ffn', 'norm': 'norm',
                     'head': 'head'}
    pool = timm.create_model('poolformer_s12')  # its head is a Sequential whose parts the model calls one by one
    found = {n for n, _, _ in component_modules(pool)}
    assert {'stem', 'stages.1.downsample', 'stages.0.blocks.0.token_mixer', 'head.norm', 'head.fc'} <= found
    assert 'head' not in found


def test_components_sum_to_the_measured_total():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = timm.create_model('deit_tiny_patch16_224', img_size=64, depth=4, embed_dim=96, num_heads=3, patch_size=8)
    r = latency_breakdown(model, torch.randn(8, 3, 64, 64), name='deit', warmup=2, repeats=9)
    parts = sum(r.components_ms.values())
    assert r.components_ms['ffn'] > 0 and r.components_ms['token mixer'] > 0 and r.components_ms['patch embed'] > 0
    # the components cover the forward: what lies between them (residual adds, position embedding) is small
    assert 0 <= r.other_ms / r.hooked_total_ms < 0.05, (parts, r.hooked_total_ms)
    # and the hooks do not distort it: the un-hooked forward takes about as long (loose: a shared CPU is noisy)
    assert abs(parts - r.plain_total_ms) / r.plain_total_ms < 0.25, (parts, r.plain_total_ms)
    assert 0 < r.share('ffn') < 1
