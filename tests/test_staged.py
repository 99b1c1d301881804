"""The timm feature interface the staged backbones share (models/backbones/staged.py::StagedBackbone): every
option of forward_intermediates and prune_intermediate_layers, on small builds of each family."""
import copy

import pytest
import timm
import torch

import vitblocks  # noqa: F401  (registers the backbones)
from vitblocks.models.backbones.staged import StagedBackbone

SMALL = {  # name -> kwargs: every family's code paths, fast
    'lvt': dict(depths=(1, 1, 1, 1)),
    'edgevit_xxs': dict(),
    'pyramid_visionllama_s': dict(depths=(1, 1, 1, 1)),
    'cyclemlp_b1': dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64)),
    'hiremlp_tiny': dict(depths=(1, 2, 1, 1), embed_dims=(16, 32, 48, 64)),
}
X = torch.randn(2, 3, 64, 96)  # non-square: stage maps 16x24 ... 2x3


def _build(name):
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=5, **SMALL[name]).eval()


@pytest.mark.parametrize('name', list(SMALL))
@torch.no_grad()
def test_forward_intermediates_options(name):
    model = _build(name)
    assert isinstance(model, StagedBackbone)
    final, inter = model.forward_intermediates(X)
    assert torch.equal(final, model.forward_features(X))
    channels, reductions = model.feature_info[-1]['num_chs'], [f['reduction'] for f in model.feature_info]
    assert [t.shape[2:] for t in inter] == [(64 // r, 96 // r) for r in reductions]  # NCHW maps
    assert inter[-1].shape[1] == channels
    only = model.forward_intermediates(X, indices=[0, 2], stop_early=True, intermediates_only=True)
    assert len(only) == 2 and torch.equal(only[0], inter[0]) and torch.equal(only[1], inter[2])
    assert torch.equal(model.forward_intermediates(X, indices=1, intermediates_only=True)[0], inter[-1])  # last 1
    normed = model.forward_intermediates(X, norm=True, intermediates_only=True)
    assert all(torch.equal(a, b) for a, b in zip(normed[:-1], inter[:-1]))  # the norm is on the last map only
    if name == 'lvt':  # its norm follows the class-attention blocks: the maps are returned as they are
        assert torch.equal(normed[-1], inter[-1])
    else:  # forward_features is the final norm of the last map
        expected = final.permute(0, 3, 1, 2) if model.channels_last else final  # (B, H, W, C) -> (B, C, H, W)
        assert torch.equal(normed[-1], expected) and not torch.equal(normed[-1], inter[-1])
    if name == 'pyramid_visionllama_s':
        nhwc = model.forward_intermediates(X, output_fmt='NHWC', intermediates_only=True)
        assert all(torch.equal(a.permute(0, 3, 1, 2), b) for a, b in zip(nhwc, inter))  # (B, H, W, C) as run
    else:
        with pytest.raises(ValueError, match=f"{type(model).__name__} intermediates are NCHW maps, got output_fmt="):
            model.forward_intermediates(X, output_fmt='NHWC')


@pytest.mark.parametrize('name', list(SMALL))
@pytest.mark.parametrize('prune_norm', [False, True])
@torch.no_grad()
def test_prune_intermediate_layers(name, prune_norm):
    model = _build(name)
    inter = model.forward_intermediates(X, intermediates_only=True)
    pruned = copy.deepcopy(model)
    assert pruned.prune_intermediate_layers([0, 2], prune_norm=prune_norm) == [0, 2]
    assert len(pruned.stages) == 3 and pruned.num_classes == 0
    kept = pruned.forward_intermediates(X, indices=[0, 2], intermediates_only=True)
    assert torch.equal(kept[0], inter[0]) and torch.equal(kept[1], inter[2])
    # the norm goes where asked (LVT's always goes with its head, which prune_head=True removes)
    assert isinstance(pruned.norm, torch.nn.Identity) == (prune_norm or name == 'lvt')
    if isinstance(pruned.norm, torch.nn.Identity):  # a kept final norm does not fit the third stage's width
        out = pruned(X)  # no classifier: the third stage's features, pooled or as a map
        assert out.shape[0] == 2 and model.feature_info[2]['num_chs'] in out.shape
    kept_head = copy.deepcopy(model)
    kept_head.prune_intermediate_layers(3, prune_head=False)  # the last 3 stages: nothing is cut
    assert len(kept_head.stages) == 4 and torch.equal(kept_head(X), model(X))


@pytest.mark.parametrize('name', list(SMALL))
def test_grad_checkpointing_recomputes_the_same_numbers(name):
    """timm's ``set_grad_checkpointing`` (its ``train.py --grad-checkpointing`` calls it on every model):
    forward, forward_intermediates and every gradient are those of the plain model."""
    model = _build(name)
    x = X.clone().requires_grad_(True)
    calls = []
    model.stages[-1].register_forward_pre_hook(lambda *_: calls.append(1))

    def run():
        model.zero_grad(set_to_none=True)
        x.grad = None
        calls.clear()
        out = model(x)
        out.square().sum().backward()
        runs = len(calls)  # a checkpointed stage runs again in the backward pass
        inter = model.forward_intermediates(X, intermediates_only=True)
        return out.detach(), inter, {n: p.grad.clone() for n, p in model.named_parameters()}, x.grad.clone(), runs

    ref_out, ref_inter, ref_grads, ref_x, ref_runs = run()
    model.set_grad_checkpointing()
    assert model.grad_checkpointing
    out, inter, grads, x_grad, runs = run()
    assert (ref_runs, runs) == (1, 2)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip(inter, ref_inter))
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-6, atol=1e-7, msg=n)
    torch.testing.assert_close(x_grad, ref_x, rtol=1e-6, atol=1e-7)
    model.set_grad_checkpointing(False)
    assert not model.grad_checkpointing


def _depth_unit(name: str):
    """Where a parameter sits from the input up, as a sortable key: the stem / first patch embedding, a
    stage's downsample, one block, LVT's class token + class blocks, the head (the final norm: its last block)."""
    parts = name.split('.')
    if parts[0] == 'stem':
        return (0,)
    if parts[0] == 'stages':
        s = int(parts[1])
        return (1, s, -1) if parts[2] in ('downsample', 'norm') else (1, s, int(parts[3]))
    if parts[0] == 'cls_token':
        return (2, 0)
    if parts[0] == 'post_blocks':
        return (2, int(parts[1]))
    if parts[0] in ('head', 'aux_head'):
        return (4,)
    assert parts[0] == 'norm', name
    return None  # the final norm: with the last block before it


def _build_for_groups(name):
    torch.manual_seed(0)
    if name == 'lvt_plain':  # no class blocks: the final norm follows the stages
        return timm.create_model('lvt', num_classes=5, class_blocks=0, **SMALL['lvt'])
    return _build(name)


@pytest.mark.parametrize('name', list(SMALL) + ['lvt_plain'])
def test_group_matcher_gives_layer_decay_one_scale_per_block(name):
    """timm's layer-wise LR decay (``create_optimizer_v2(..., layer_decay=)``) reads ``group_matcher``; without
    it timm cut the parameter list into runs of 12 tensors, so one block's weights got several learning rates.
    Each unit (stem, downsample, block, head) gets one scale, decaying by ``layer_decay`` per unit from the head."""
    from timm.optim._param_groups import param_groups_layer_decay
    model = _build_for_groups(name)
    decay = 0.65
    names = {id(p): n for n, p in model.named_parameters()}
    scale = {names[id(p)]: g['lr_scale'] for g in param_groups_layer_decay(model, layer_decay=decay)
             for p in g['params']}
    assert scale.keys() == set(names.values())
    units = {n: _depth_unit(n) for n in scale}
    order = sorted({u for u in units.values() if u is not None})
    units = {n: (order[-2] if u is None else u) for n, u in units.items()}  # the final norm: the unit before the head
    expected = {u: decay ** (len(order) - 1 - k) for k, u in enumerate(order)}
    wrong = {n: (s, expected[units[n]]) for n, s in scale.items() if abs(s - expected[units[n]]) > 1e-12}
    assert not wrong, f'{len(wrong)} parameters with another lr_scale than their unit, e.g. {list(wrong.items())[:3]}'


@pytest.mark.parametrize('name', list(SMALL) + ['lvt_plain'])
def test_group_matcher_coarse_is_one_group_per_stage(name):
    from timm.models._manipulate import group_parameters
    model = _build_for_groups(name)
    groups = list(group_parameters(model, model.group_matcher(coarse=True)).values())  # in depth order
    stage_of = [{int(n.split('.')[1]) for n in g if n.startswith('stages.')} for g in groups]
    taken = [s for s in stage_of if s]
    assert taken == [{0}, {1}, {2}, {3}]  # each stage whole in one group, in order
    for g, s in zip(groups, stage_of):
        assert not s or all(n.startswith(('stages.', 'norm.')) for n in g), g  # only the final norm joins a stage
    last_stage = groups[max(i for i, s in enumerate(stage_of) if s)]
    assert any(n.startswith('norm.') for n in last_stage) or not any(  # it joins the last stage
        n.startswith('norm.') for g in groups for n in g)
    assert any(n.startswith('head') for n in groups[-1])


@pytest.mark.parametrize('name, conv', [('lvt', 'fan_out'), ('pyramid_visionllama_s', 'fan_out'), ('edgevit_xxs', None),
                                        ('cyclemlp_b1', None), ('hiremlp_tiny', 'trunc_normal')])
def test_each_family_starts_from_its_authors_init(name, conv):
    """Linears trunc-normal (std 0.02) with zero biases; convs as each family's authors (models/backbones/staged.py)."""
    from vitblocks.models.backbones.staged import authors_init
    assert type(_build(name))._init_weights.keywords == {'conv': conv}
    torch.manual_seed(0)
    linear, dw = torch.nn.Linear(256, 512), torch.nn.Conv2d(64, 64, 7, groups=64)
    torch.nn.init.ones_(dw.bias)
    default_std = dw.weight.std().item()  # torch's: kaiming-uniform, std 1 / sqrt(3 * 49) = 0.082
    for m in (linear, dw):
        authors_init(m, conv)
    assert linear.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert not linear.bias.any()
    want_std = {None: default_std, 'fan_out': (2 / 49) ** 0.5, 'trunc_normal': 0.02}[conv]  # fan_out: 7*7*64 / 64
    assert dw.weight.std().item() == pytest.approx(want_std, rel=0.05)
    assert dw.bias.eq(0 if conv else 1).all()  # torch's conv init leaves our ones alone
    with pytest.raises(ValueError, match="conv='xavier': expected one of"):
        authors_init(linear, 'xavier')
