"""Latency per component (RePa Fig. 3): components cover the forward and sum to its measured time."""
import time

import pytest
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


def test_components_sum_to_the_measured_total_with_known_costs():
    """Each component gets a known cost (a 10 ms sleep inside its forward, before the breakdown's own
    post-hook reads the clock): the accounting is then checked with numbers that a busy CPU cannot
    blur, since the un-slept work of this tiny model is a small fraction of a millisecond."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, depth=2, embed_dim=16, num_heads=2, patch_size=8)
    cost = 0.010
    calls = {}
    handles = []
    for _, comp, module in component_modules(model):
        calls[comp] = calls.get(comp, 0) + 1
        handles.append(module.register_forward_hook(lambda *_: time.sleep(cost)))  # registered first: inside
    try:
        r = latency_breakdown(model, torch.randn(2, 3, 32, 32), name='deit', warmup=1, repeats=3)
    finally:
        for h in handles:
            h.remove()
    assert calls == {'patch embed': 1, 'token mixer': 2, 'ffn': 2, 'norm': 5, 'head': 1}
    for comp, n in calls.items():  # each component holds at least its injected cost
        assert r.components_ms[comp] >= 1e3 * cost * n, (comp, r.components_ms)
    parts = sum(r.components_ms.values())
    assert parts >= 1e3 * cost * 11
    # what lies between components (pos-embed, residual adds) is tiny here: components cover the forward
    assert 0 <= r.other_ms / r.hooked_total_ms < 0.05, (parts, r.hooked_total_ms)
    assert abs(parts - r.plain_total_ms) / r.plain_total_ms < 0.10, (parts, r.plain_total_ms)
    assert r.share('ffn') == pytest.approx(r.components_ms['ffn'] / r.hooked_total_ms)


@pytest.mark.slow  # real timings: on a busy 2-core CPU the uncovered share of this small model varies
def test_components_sum_to_the_measured_total():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = timm.create_model('deit_tiny_patch16_224', img_size=64, depth=4, patch_size=8)  # width 192
    r = latency_breakdown(model, torch.randn(8, 3, 64, 64), name='deit', warmup=2, repeats=9)
    parts = sum(r.components_ms.values())
    assert r.components_ms['ffn'] > 0 and r.components_ms['token mixer'] > 0 and r.components_ms['patch embed'] > 0
    # the components cover the forward: what lies between them (residual adds, position embedding) is small
    assert 0 <= r.other_ms / r.hooked_total_ms < 0.05, (parts, r.hooked_total_ms)
    # and the hooks do not distort it: the un-hooked forward takes about as long (loose: a shared CPU is noisy)
    assert abs(parts - r.plain_total_ms) / r.plain_total_ms < 0.25, (parts, r.plain_total_ms)
    assert 0 < r.share('ffn') < 1
