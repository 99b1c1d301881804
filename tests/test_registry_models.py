"""Every registered model: builds through timm, trains one step, every parameter gets a gradient."""
import pytest
import timm
import torch

import vitblocks
from vitblocks.models import get_variant

ALL_MODELS = vitblocks.list_models()


def test_registry_is_populated_and_prefixed():
    assert len(ALL_MODELS) >= 11
    timm_names = set(n for n in timm.list_models() if not any(n == m for m in ALL_MODELS))
    for name in ALL_MODELS:
        spec = get_variant(name)
        assert name.startswith(spec.method + '_')
        assert name.endswith(spec.base)
        assert spec.base in timm_names, f'{name} must be built on a timm model, not replace one'


@pytest.mark.parametrize('name', ALL_MODELS)
def test_forward_backward(name):
    model = timm.create_model(name, num_classes=10)
    assert model.pretrained_cfg['architecture'] == name
    x = torch.randn(2, *model.pretrained_cfg['input_size'])
    out = model(x)
    assert out.shape == (2, 10)
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, f'{name}: {pname} received no gradient'
        assert torch.isfinite(p.grad).all(), f'{name}: {pname} has a non-finite gradient'


def test_timm_create_model_after_import():
    model = timm.create_model('iffn_swin_tiny_patch4_window7_224', num_classes=5)
    assert sum(isinstance(m, vitblocks.layers.IFFN) for m in model.modules()) == 12


def test_no_pretrained_weights_are_claimed():
    with pytest.raises(RuntimeError, match='no published pretrained weights'):
        timm.create_model('iffn_deit_tiny_patch16_224', pretrained=True)


def test_block_cfg_overrides_variant_config():
    model = timm.create_model('iffn_deit_tiny_patch16_224', block_cfg=dict(kernel_size=7))
    assert model.blocks[0].mlp.spatial.conv.kernel_size == (7, 7)


def test_unknown_model_gets_suggestion():
    with pytest.raises(ValueError, match='Did you mean: iffn_deit_tiny_patch16_224'):
        vitblocks.models.resolve_model_name('iffn_deit_tiny_patch16_22')
