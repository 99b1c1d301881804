"""Lipschitz bounds of an FFN (IFFN Theorem 4.3): exact cases, ordering lower <= SDP <= naive."""

import numpy as np
import pytest
import timm
import torch

pytest.importorskip('cvxpy')
from vitblocks.analysis.lipschitz import (agelu_slopes, ffn_lipschitz, jacobian_norm_lower_bound,  # noqa: E402
                                          model_lipschitz, sdp_lipschitz_bound, slope_range)
from vitblocks.layers import IFFN  # noqa: E402


@pytest.mark.parametrize('base', ['gelu', 'silu', 'relu', 'elu', 'softplus'])
def test_slope_range_brackets_the_derivative(base):
    from vitblocks.layers.activations import BASE_ACTIVATIONS
    x = torch.linspace(-8, 8, 100001, dtype=torch.float64, requires_grad=True)
    (d,) = torch.autograd.grad(BASE_ACTIVATIONS[base](x).sum(), x)
    p, q = slope_range(base)
    assert p <= d.min().item() + 1e-9 and d.max().item() <= q + 1e-9
    assert d.min().item() == pytest.approx(p, abs=2e-3) and d.max().item() == pytest.approx(q, abs=2e-3)
    if base == 'gelu':  # closed form at +-sqrt(2)
        assert (p, q) == pytest.approx((-0.128904145, 1.128904145), abs=1e-8)


def test_agelu_slopes_scale_by_alpha_beta_and_swap_when_negative():
    p, q = agelu_slopes(torch.tensor([2.0, -1.0, 0.5]), torch.tensor([1.0, 1.0, -3.0]))
    p0, q0 = slope_range('gelu')
    np.testing.assert_allclose(p, [2 * p0, -q0, -1.5 * q0])
    np.testing.assert_allclose(q, [2 * q0, -p0, -1.5 * p0])


def test_sdp_is_exact_for_a_single_linear_layer():
    w = np.random.default_rng(0).normal(size=(6, 5))
    exact = np.linalg.norm(w, 2)
    # W after a ReLU (slopes [0, 1]): L = ||W|| exactly, attained by the SDP at T = ||W||^2 I
    bound = sdp_lipschitz_bound(np.eye(5), w, np.zeros(5), np.ones(5), solver='CLARABEL')
    assert bound == pytest.approx(exact, rel=1e-6)
    # x -> W x as W1 phi(W0 x) with phi = identity (slopes [1, 1]): the SDP's infimum is ||W|| but is
    # approached only as T -> infinity, so the solver gets within its tolerance
    bound = sdp_lipschitz_bound(w, np.eye(6), np.ones(6), np.ones(6), solver='CLARABEL')
    assert bound == pytest.approx(exact, rel=1e-3)


def test_sdp_rejects_shapes_that_do_not_chain():
    with pytest.raises(ValueError, match='shapes do not chain'):
        sdp_lipschitz_bound(np.eye(4), np.eye(3), np.zeros(4), np.ones(4))


def test_power_iteration_finds_the_exact_jacobian_norm():
    torch.manual_seed(0)
    w = torch.randn(7, 5, dtype=torch.float64)
    def f(x):
        return torch.tanh(x) @ w.t()  # (B, 5) -> (B, 7), row-wise
    x = torch.randn(3, 5, dtype=torch.float64)
    got = jacobian_norm_lower_bound(f, x, iters=200)
    exact = torch.stack([torch.linalg.matrix_norm(w * (1 - torch.tanh(xi) ** 2), ord=2) for xi in x])
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=0)


def _trained_like_iffn():
    torch.manual_seed(0)
    ffn = IFFN(8, 32, grid_size=(2, 2), num_prefix_tokens=1).double().eval()
    with torch.no_grad():  # AGeLU parameters away from their init, some slopes negative
        for p in (ffn.act.alpha, ffn.act.beta):
            p.copy_(torch.randn_like(p))
        ffn.act.gamma.normal_()
        for m in (ffn.fc1, ffn.fc2):
            m.weight.normal_(0, 0.3)
    return ffn


def test_iffn_bounds_are_ordered_and_name_what_the_theorem_leaves_out():
    ffn = _trained_like_iffn()
    r = ffn_lipschitz(ffn, torch.randn(6, 5, 8), solver='SCS')
    assert r.kind == 'IFFN' and r.slope_min < 0
    assert r.empirical <= r.sdp * (1 + 1e-6) and r.sdp < r.naive
    assert 0.3 * r.sdp < r.empirical  # the bound is not vacuous on this small layer
    assert 'LayerNorm' in r.note and 'depthwise' in r.note
    assert r.module_empirical > 0


def test_model_lipschitz_per_block_and_unsupported_ffns():
    torch.manual_seed(0)
    kw = dict(img_size=16, patch_size=8, depth=2, embed_dim=8, num_heads=2, mlp_ratio=2, num_classes=3)
    rows = model_lipschitz(timm.create_model('deit_tiny_patch16_224', **kw), torch.randn(2, 3, 16, 16))
    assert [r.name for r in rows] == ['blocks.0.mlp', 'blocks.1.mlp']
    for r in rows:  # a timm Mlp is the theorem's f exactly: nothing left out
        assert r.empirical <= r.sdp * (1 + 1e-6) <= r.naive * (1 + 1e-6)
        assert r.note == 'theorem holds for the whole module'
        assert r.module_empirical == pytest.approx(r.empirical, rel=0.05)  # same function, per image vs per token
    afbo = model_lipschitz(timm.create_model('afbo_deit_tiny_patch16_224', **kw), torch.randn(1, 3, 16, 16), blocks=[1])
    assert len(afbo) == 1 and afbo[0].sdp is None and 'not of the form' in afbo[0].note
    with pytest.raises(ValueError, match='out of range'):
        model_lipschitz(timm.create_model('deit_tiny_patch16_224', **kw), torch.randn(1, 3, 16, 16), blocks=[5])


def _tiny_poolformer():
    """timm's PoolFormer (channels-first blocks, 1x1-conv Mlp with GELU), shrunk."""
    from timm.models.metaformer import GroupNorm1, MetaFormer, Pooling
    torch.manual_seed(0)
    return MetaFormer(depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), num_classes=3, token_mixers=Pooling,
                      norm_layers=GroupNorm1, mlp_act=torch.nn.GELU, use_mlp_head=False).eval()


def test_channels_first_ffn_is_bounded_like_its_token_wise_twin():
    """PoolFormer's FFN reads (B, C, H, W) maps: the bounds must be those of the same weights as a
    channels-last Mlp on the same tokens (not a reading of W as the channel axis, nor a shape error)."""
    model = _tiny_poolformer()
    x = torch.randn(2, 3, 64, 64)
    (got,) = model_lipschitz(model, x, blocks=[0])
    conv = model.stages[0].blocks[0].mlp
    assert got.kind == 'Mlp' and got.sdp is not None
    twin = timm.layers.Mlp(8, 32, bias=False).eval()
    with torch.no_grad():
        twin.fc1.weight.copy_(conv.fc1.weight.flatten(1))
        twin.fc2.weight.copy_(conv.fc2.weight.flatten(1))
    seen = {}
    h = conv.register_forward_pre_hook(lambda m, a: seen.setdefault('x', a[0]))
    with torch.no_grad():
        model(x)
    h.remove()
    want = ffn_lipschitz(twin, seen['x'].permute(0, 2, 3, 1), name=got.name)  # (B, C, H, W) -> (B, H, W, C)
    assert got.naive == pytest.approx(want.naive, rel=1e-9)
    assert got.sdp == pytest.approx(want.sdp, rel=1e-3)
    assert got.empirical == pytest.approx(want.empirical, rel=1e-6)
    assert got.module_empirical == pytest.approx(want.module_empirical, rel=0.05)  # power iteration from another start
    assert got.empirical <= got.sdp * (1 + 1e-6) <= got.naive * (1 + 1e-6)


def test_ffn_lipschitz_rejects_tokens_of_another_width():
    with pytest.raises(ValueError, match='have 5 channels last, the FFN reads 8'):
        ffn_lipschitz(_trained_like_iffn(), torch.randn(2, 8, 5))
    conv = _tiny_poolformer().stages[0].blocks[0].mlp
    with pytest.raises(ValueError, match=r'\(B, H, W, C\) for a 1x1-conv FFN'):
        ffn_lipschitz(conv, torch.randn(2, 16, 8))  # tokens, but the module wants a map


def test_iffn_form_is_its_channel_part_and_naive_bound_is_the_norm_product():
    """The theorem's f for an IFFN is fc2(concat(A_1(fc1 x), A_2(fc1 x))) (LayerNorms and depthwise block left
    out), W1 split by copy, each part with the slopes of its own AGeLU; naive = sum_i ||W1_i|| max|slope_i| ||W0||."""
    from vitblocks.analysis.lipschitz import affn_form
    ffn = _trained_like_iffn()
    form, note = affn_form(ffn)
    assert note == '' and len(form.w1_parts) == 2
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.no_grad():
        expected = ffn.fc2(ffn.act(ffn.fc1(x)))  # Eq. 13: W1 [phi_1(W0 x + b0); phi_2(W0 x + b0)] + b1
        torch.testing.assert_close(form(x), expected, rtol=1e-12, atol=1e-12)
    for i, (p, q) in enumerate(form.slopes):
        p_i, q_i = agelu_slopes(ffn.act.alpha[i], ffn.act.beta[i])
        np.testing.assert_array_equal(p, p_i)
        np.testing.assert_array_equal(q, q_i)
    torch.manual_seed(1)
    small = IFFN(2, 4, spatial_part=False).double().eval()  # a tiny SDP: the naive bound is what is checked
    with torch.no_grad():  # the largest |alpha * beta| of each copy is negative: there max|slope| = |p| > q
        small.act.alpha.copy_(torch.tensor([[-2., 0.5], [1., -3.]]))
    form = affn_form(small)[0]
    r = ffn_lipschitz(small, torch.randn(2, 3, 2), solver='CLARABEL', iters=5)
    w0 = small.fc1.weight.detach()
    naive = sum(torch.linalg.matrix_norm(w, ord=2).item() * max(np.abs(p).max(), np.abs(q).max())
                for w, (p, q) in zip(form.w1_parts, form.slopes)) * torch.linalg.matrix_norm(w0, ord=2).item()
    assert r.naive == pytest.approx(naive, rel=1e-9)
