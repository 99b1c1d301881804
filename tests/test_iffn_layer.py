"""IFFN layers: activations, structure per the paper, layouts, errors."""
import pytest
import torch
import torch.nn.functional as F

from vitblocks.layers import AGeLU, ArbitraryActivation, ConcatArbitraryActivations, IFFN, SumOfNonlinearities
from _helpers import perturb_


def test_agelu_at_init_equals_gelu():
    x = torch.randn(4, 10, 16) * 3
    torch.testing.assert_close(AGeLU(16)(x), F.gelu(x), rtol=0, atol=0)


@pytest.mark.parametrize('base,fn', [('softplus', F.softplus), ('elu', F.elu), ('silu', F.silu), ('relu', F.relu)])
def test_arbitrary_activation_formula(base, fn):
    act = ArbitraryActivation(8, base)
    perturb_(act, std=0.2, batchnorm=True)
    x = torch.randn(3, 8)
    expected = act.beta * fn(act.alpha * x + act.gamma) + act.theta  # Eq. 3
    torch.testing.assert_close(act(x), expected)


def test_concatenated_activations_equal_separate_copies():
    cat = ConcatArbitraryActivations(6, num_functions=3)
    perturb_(cat, std=0.2, batchnorm=True)
    x = torch.randn(2, 5, 6)
    parts = []
    for i in range(3):
        a = AGeLU(6)
        with torch.no_grad():
            for name in ('alpha', 'gamma', 'beta', 'theta'):
                getattr(a, name).copy_(getattr(cat, name)[i])
        parts.append(a(x))
    torch.testing.assert_close(cat(x), torch.cat(parts, dim=-1))
    # channels-first gives the same numbers
    cat_cf = ConcatArbitraryActivations(6, num_functions=3, channels_first=True)
    cat_cf.load_state_dict(cat.state_dict())
    xm = x.reshape(2, 5, 6, 1).permute(0, 2, 1, 3)  # (B, N, C) -> (B, C, N, 1)
    torch.testing.assert_close(cat_cf(xm).permute(0, 2, 3, 1).reshape(2, 5, 18), cat(x))


def _iffn_block_params(c, hidden, k, n_fn=2, channel=True, spatial=True):
    """Parameter count of one IFFN block, written from the paper's description."""
    fc1_out = hidden // n_fn if channel else hidden
    total = c * fc1_out + fc1_out  # fc1
    if channel:
        total += 4 * fc1_out * n_fn  # alpha, gamma, beta, theta per channel per function
        total += 2 * hidden  # LayerNorm(C')
    if spatial:
        total += hidden * k * k + hidden  # depthwise conv with bias
        total += 2 * hidden  # BatchNorm affine
    total += hidden * c + c  # fc2
    total += 2 * c  # output LayerNorm(C)
    return total


@pytest.mark.parametrize('cfg', [dict(), dict(kernel_size=5), dict(kernel_size=1), dict(num_functions=4),
                                 dict(spatial_part=False), dict(channel_part=False)])
def test_parameter_count_matches_structure(cfg):
    ffn = IFFN(192, 768, grid_size=(14, 14), **cfg)
    expected = _iffn_block_params(192, 768, cfg.get('kernel_size', 3), cfg.get('num_functions', 2),
                                  cfg.get('channel_part', True), cfg.get('spatial_part', True))
    assert sum(p.numel() for p in ffn.parameters()) == expected


def test_prefix_tokens_bypass_spatial_part():
    torch.manual_seed(1)
    ffn = IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=2).eval()
    perturb_(ffn, std=0.2, batchnorm=True)
    no_spatial = IFFN(16, 64, grid_size=(3, 4), num_prefix_tokens=2, spatial_part=False).eval()
    no_spatial.load_state_dict({k: v for k, v in ffn.state_dict().items() if not k.startswith('spatial')})
    x = torch.randn(2, 2 + 12, 16)
    y, y_plain = ffn(x), no_spatial(x)
    torch.testing.assert_close(y[:, :2], y_plain[:, :2])  # prefix tokens: per-token path only
    assert (y[:, 2:] - y_plain[:, 2:]).abs().max() > 1e-3  # patch tokens: spatial part active
    x2 = x.clone()
    x2[:, 2:] += torch.randn_like(x2[:, 2:])
    torch.testing.assert_close(ffn(x2)[:, :2], y[:, :2])  # patches never leak into prefix tokens


def test_spatial_part_sees_the_grid_not_the_sequence():
    """A token's output depends on its 2-D neighbours: the token below it (index + W) matters."""
    ffn = IFFN(8, 32, grid_size=(3, 5)).eval()
    perturb_(ffn, std=0.2, batchnorm=True)
    x = torch.randn(1, 15, 8)
    x2 = x.clone()
    x2[0, 7] += 1.0  # grid position (1, 2)
    diff = (ffn(x2) - ffn(x)).abs().sum(-1)[0]
    changed = set(torch.nonzero(diff > 1e-6).flatten().tolist())
    assert changed == {1, 2, 3, 6, 7, 8, 11, 12, 13}  # the 3x3 neighbourhood of (1, 2)


def test_token_and_channels_first_layouts_agree():
    tok = IFFN(16, 64, grid_size=(4, 6)).eval()
    perturb_(tok, std=0.2, batchnorm=True)
    cf = IFFN(16, 64, channels_first=True).eval()
    state = {k: (v.reshape(*v.shape, 1, 1) if k in ('fc1.weight', 'fc2.weight') else v)
             for k, v in tok.state_dict().items()}
    cf.load_state_dict(state)
    x = torch.randn(2, 24, 16)
    xm = x.reshape(2, 4, 6, 16).permute(0, 3, 1, 2)  # (B, N, C) -> (B, C, H, W)
    torch.testing.assert_close(cf(xm).permute(0, 2, 3, 1).reshape(2, 24, 16), tok(x), rtol=1e-5, atol=1e-5)
    # channels-last maps (B, H, W, C) are accepted by the token-layout layer as well
    torch.testing.assert_close(tok(x.reshape(2, 4, 6, 16)).reshape(2, 24, 16), tok(x), rtol=1e-5, atol=1e-5)


def test_bad_configs_raise_specific_errors():
    with pytest.raises(ValueError, match='not divisible by num_functions=5'):
        IFFN(16, 64, num_functions=5)
    with pytest.raises(ValueError, match='positive odd'):
        IFFN(16, 64, kernel_size=4)
    with pytest.raises(ValueError, match='unknown activation'):
        IFFN(16, 64, act_layer='tanhh')


def test_sum_of_nonlinearities_is_channelwise():
    m = SumOfNonlinearities(8, 32, functions_per_channel=4)
    perturb_(m, std=0.2, batchnorm=True)
    x = torch.randn(2, 5, 8)
    x2 = x.clone()
    x2[..., 3] += 1
    changed = (m(x2) - m(x)).abs().sum((0, 1)) > 0
    assert changed.tolist() == [i == 3 for i in range(8)]
    with pytest.raises(ValueError, match='must equal in_features'):
        SumOfNonlinearities(8, 32, out_features=4)


def test_eq11_has_4c_functions_per_channel():
    """Eq. 11 / Corollary 3.1: each channel is a sum of C' = 4C functions of itself (4C x C in all)."""
    m = SumOfNonlinearities(8, 32)  # C = 8, C' = 32
    assert m.functions_per_channel == 32 and m.act.alpha.shape == (32, 8)
    perturb_(m, std=0.2, batchnorm=True)
    x = torch.randn(2, 5, 8)
    a = m.act
    expected = (a.beta * F.gelu(a.alpha * x.unsqueeze(-2) + a.gamma) + a.theta).sum(-2)  # (..., 32, 8) -> (..., 8)
    torch.testing.assert_close(m(x), expected)


def test_eq11_with_gelu_is_4c_times_gelu_and_has_no_parameters():
    plain = SumOfNonlinearities(8, 32, arbitrary=False)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(plain(x), 32 * F.gelu(x))  # 4C identical GeLU terms, no weights in Eq. 11
    assert sum(p.numel() for p in plain.parameters()) == 0


def test_table3_swaps_every_gelu_of_iffn_unless_told():
    """Table 3 replaces GeLU by another function: with IFFN both the AGeLU base and the depthwise
    block's activation; ``spatial_act_layer`` keeps the block's GELU explicitly."""
    both = IFFN(16, 64, act_layer='softplus', grid_size=(2, 3))
    assert both.act.base == 'softplus' and both.spatial.act_name == 'softplus'
    base_only = IFFN(16, 64, act_layer='softplus', spatial_act_layer='gelu', grid_size=(2, 3))
    assert base_only.act.base == 'softplus' and base_only.spatial.act_name == 'gelu'
    assert IFFN(16, 64, act_layer=torch.nn.SiLU, grid_size=(2, 3)).spatial.act_name == 'silu'
    fused = both.eval().fuse()  # the deploy path uses the same activation
    x = torch.randn(2, 6, 16)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), both(x), rtol=1e-5, atol=1e-5)


def test_dropout_follows_the_hidden_layernorm():
    """The authors' model: fc1, activations, LayerNorm, dropout, spatial block."""
    m = IFFN(16, 64, drop=(0.5, 0.), grid_size=(2, 3)).train()
    seen = []
    m.norm.register_forward_hook(lambda mod, args, out: seen.append('norm'))
    m.drop1.register_forward_hook(lambda mod, args, out: seen.append('drop1'))
    m.spatial.register_forward_hook(lambda mod, args, out: seen.append('spatial'))
    m(torch.randn(2, 6, 16))
    assert seen == ['norm', 'drop1', 'spatial']


def test_default_widths_follow_the_authors_model():
    """IFFN(C) with no widths given: hidden C' = 4C (timm Mlp's default), fc1 C -> C'/N = 2C, two AGeLUs,
    a 3x3 depthwise block with GELU, fc2 4C -> C."""
    m = IFFN(16, grid_size=(2, 3))
    assert (m.fc1.in_features, m.fc1.out_features) == (16, 32)
    assert (m.fc2.in_features, m.fc2.out_features) == (64, 16)
    assert m.hidden_features == 64 and m.act.num_functions == 2 and m.act.alpha.shape == (2, 32)
    assert m.spatial.conv.kernel_size == (3, 3) and m.act.base == 'gelu' and m.spatial.act_name == 'gelu'
    assert m.norm.normalized_shape == (64,) and m.norm_out.normalized_shape == (16,)
    assert SumOfNonlinearities(8).functions_per_channel == 32  # Eq. 11: C' = 4C functions per channel


def test_forward_matches_the_authors_definition_written_out():
    """fc1 -> [A_1 | A_2] -> LayerNorm(4C) -> y + GELU(BN(DWConv3x3(y))) -> fc2 -> LayerNorm(C), with the
    BatchNorm in eval mode (random statistics), in float64, against F.* calls only."""
    torch.manual_seed(3)
    m = perturb_(IFFN(8, 32, grid_size=(3, 4), num_prefix_tokens=1).double(), std=0.3, batchnorm=True).eval()
    x = torch.randn(2, 1 + 12, 8, dtype=torch.float64)
    a = m.act
    h = F.linear(x, m.fc1.weight, m.fc1.bias)  # (B, N, 16)
    y = torch.cat([a.beta[i] * F.gelu(a.alpha[i] * h + a.gamma[i]) + a.theta[i] for i in range(2)], -1)  # Eq. 5
    y = F.layer_norm(y, (32,), m.norm.weight, m.norm.bias, m.norm.eps)
    fmap = y[:, 1:].reshape(2, 3, 4, 32).permute(0, 3, 1, 2)  # patch tokens as (B, C', H, W)
    bn, conv = m.spatial.bn, m.spatial.conv
    z = F.conv2d(fmap, conv.weight, conv.bias, padding=1, groups=32)
    z = F.batch_norm(z, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0., bn.eps)
    fmap = fmap + F.gelu(z)
    y = torch.cat([y[:, :1], fmap.permute(0, 2, 3, 1).reshape(2, 12, 32)], 1)  # class token skips the spatial part
    out = F.layer_norm(F.linear(y, m.fc2.weight, m.fc2.bias), (8,), m.norm_out.weight, m.norm_out.bias, m.norm_out.eps)
    torch.testing.assert_close(m(x), out, rtol=1e-10, atol=1e-10)
    with torch.inference_mode():
        torch.testing.assert_close(m.fuse()(x), out, rtol=1e-10, atol=1e-10)  # deploy path, folded BN


def test_activation_aliases_name_the_same_functions():
    """Table 3's 'Swish' is SiLU, x * sigmoid(x); 'hard_swish' is Hardswish."""
    from vitblocks.layers.activations import act_fn, activation_name
    assert activation_name('swish') == activation_name('Swish') == 'silu'
    assert activation_name('hard_swish') == 'hardswish'
    x = torch.linspace(-4, 4, 9)
    torch.testing.assert_close(act_fn('swish')(x), x * torch.sigmoid(x))
    assert IFFN(8, 16, act_layer='swish', grid_size=(1, 2)).act.base == 'silu'
