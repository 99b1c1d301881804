"""Every registered model: builds through timm, trains one step, every parameter gets a gradient."""
import pytest
import timm
import torch

import vitblocks
from vitblocks.models import get_variant

ALL_MODELS = vitblocks.list_models()
BACKBONES = vitblocks.models.list_backbones()  # not-in-timm backbones vitblocks registers with timm


def test_registry_is_populated_and_prefixed():
    assert len(ALL_MODELS) >= 11
    timm_names = set(n for n in timm.list_models() if not any(n == m for m in ALL_MODELS))
    for name in ALL_MODELS:
        spec = get_variant(name)
        assert name.startswith(spec.method + '_')
        # the name ends with the timm base, or the description says why not (e.g. ViT-H/16 built
        # from timm's ViT-H/14 entry with patch 16)
        assert name.endswith(spec.base) or spec.base in spec.description, name
        assert spec.base in timm_names, f'{name} must be built on a timm model, not replace one'


def _small_input_kwargs(name):
    """Shrink the input where the architecture allows it, to keep the registry loop fast on CPU."""
    base = get_variant(name).base if name in ALL_MODELS else name
    if base.startswith(('deit', 'vit_')) and 'patch16' in base or base.startswith('lvvit'):
        return dict(img_size=64)
    return {}


_HEAVY = ('large', 'huge', '_m36', '_m48', 'swin_small', 'swin_base', 'mixer_l16', 'deit_base', 'vit_base',
          'lvvit', 'lvt',  # LV-ViT, LVT: tests/test_lvvit.py, test_lvt.py run the same checks fast (small inputs)
          'visionllama')  # Pyramid VisionLLaMA: tests/test_vision_llama.py, the same checks on 64 px
_HEAVY_PREFIXES = ('scheme_',)  # E = 8 MLPs on PoolFormer/Swin at 224 px: tests/test_scheme.py runs narrow copies
_HEAVY += ('cyclemlp', 'hiremlp')  # tests/test_cyclemlp.py, test_hiremlp.py: the same checks, small models


def _marks(name):
    """Big models (> ~50 M params or Swin at 224) run only with `-m slow` (make test-all)."""
    base = get_variant(name).base if name in ALL_MODELS else name
    return [pytest.mark.slow] if any(h in base for h in _HEAVY) or name.startswith(_HEAVY_PREFIXES) else []


@pytest.mark.parametrize('name', [pytest.param(n, marks=_marks(n)) for n in ALL_MODELS + BACKBONES])
def test_forward_backward(name):
    model = timm.create_model(name, num_classes=10, **_small_input_kwargs(name))
    assert model.pretrained_cfg['architecture'] == name
    in_chans = model.pretrained_cfg['input_size'][0]
    img_size = getattr(getattr(model, 'patch_embed', None), 'img_size', model.pretrained_cfg['input_size'][1:])
    x = torch.randn(2, in_chans, *img_size)
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


def test_get_variant_reads_the_architecture_before_a_weight_tag():
    """timm's "the name is the architecture, the dot suffix is the weights": a tagged name was a bare KeyError."""
    assert get_variant('iffn_deit_tiny_patch16_224.in1k') is get_variant('iffn_deit_tiny_patch16_224')
    with pytest.raises(ValueError, match="unknown model 'iffn_deit_tiny_patch16_22.in1k'"):
        get_variant('iffn_deit_tiny_patch16_22.in1k')
