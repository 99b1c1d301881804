"""Dense prediction: features_only / forward_intermediates for every swapped backbone family, and a
torchvision Mask R-CNN whose backbone is a vitblocks model (training step, inference, folding)."""
import copy

import pytest
import timm
import torch
from timm.models._features import FeatureGetterNet
from torchvision.models.detection import MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator

from vitblocks.deploy import reparameterize
from vitblocks.layers import AFBO, IFFN, RePaFFN
from vitblocks.models import get_variant
from vitblocks.models.dense import FeaturePyramidBackbone
from vitblocks.models.features import features_only

from _helpers import randomize_batchnorm_

# one model per swapped family, built small (64 px) where the family allows another size;
# (name, timm kwargs, swapped layer class)
FAMILIES = [
    pytest.param('iffn_deit_tiny_patch16_224', dict(img_size=64), IFFN, marks=pytest.mark.slow),  # no class token
    ('repa_deit_tiny_patch16_224', dict(img_size=64), RePaFFN),  # with a class token (prefix)
    ('iffn_swin_tiny_patch4_window7_224', dict(img_size=64, window_size=2), IFFN),
    ('iffn_poolformer_s12', {}, IFFN),
    ('afbo_pvt_v2_b1', {}, AFBO),
    pytest.param('afbo_gcvit_xxtiny', dict(img_size=64), AFBO, marks=pytest.mark.slow),
    pytest.param('repa_mixer_b16_224', dict(img_size=64), RePaFFN, marks=pytest.mark.slow),
]


def _nchw(t, channels_last):
    return t.permute(0, 3, 1, 2) if channels_last else t  # (B, H, W, C) -> (B, C, H, W)


@pytest.mark.parametrize('name,kwargs,layer', FAMILIES, ids=lambda v: v if isinstance(v, str) else '')
def test_features_only_and_intermediates(name, kwargs, layer):
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = features_only(copy.deepcopy(model), name)  # the wrapper timm.create_model(features_only=True) returns
    assert sum(isinstance(m, layer) for m in feats.modules()) > 0, 'the swapped blocks are in the feature model'

    # feature_info: as timm's wrapper of the unswapped base (same modules, channels, strides) ...
    spec = get_variant(name)
    base = timm.create_model(spec.base, features_only=True, **{**spec.base_kwargs, **kwargs})
    assert feats.feature_info.get_dicts() == base.feature_info.get_dicts()
    # ... and true of the maps: channels and stride (64 px input, so H = 64 / reduction exactly)
    channels_last = getattr(feats, 'output_fmt', 'NCHW') == 'NHWC'
    with torch.no_grad():
        outs = [_nchw(o, channels_last) for o in feats(x)]
    assert len(outs) >= 3
    for o, c, r in zip(outs, feats.feature_info.channels(), feats.feature_info.reduction()):
        assert o.shape == (2, c, 64 // r, 64 // r)
        assert torch.isfinite(o).all()

    # forward_intermediates on the full model (NCHW): final features = forward_features, and the
    # intermediates are the features_only maps (same weights; the last 3 blocks or every stage)
    getter = isinstance(feats, FeatureGetterNet)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=3 if getter else None)
        torch.testing.assert_close(final, model.forward_features(x))
    assert len(inter) == len(outs)
    for a, b in zip(inter, outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if name.startswith('repa_deit'):  # the class token comes back separately, the maps are patches only
        with torch.no_grad():
            _, inter_p = model.forward_intermediates(x, indices=3, return_prefix_tokens=True)
        assert all(t.shape == (2, 192, 4, 4) and p.shape == (2, 1, 192) for t, p in inter_p)


def _mask_rcnn(backbone_name, **kwargs):
    backbone = FeaturePyramidBackbone(backbone_name, out_channels=32, **kwargs)
    anchors = AnchorGenerator(((8,), (16,), (32,), (64,), (128,)), ((0.5, 1.0, 2.0),) * 5)
    return MaskRCNN(backbone, num_classes=3, min_size=64, max_size=64, rpn_anchor_generator=anchors,
                    rpn_batch_size_per_image=32, box_batch_size_per_image=16)


def _targets(n=2):
    masks = torch.zeros(1, 64, 64, dtype=torch.uint8)
    masks[:, 10:40, 12:50] = 1
    return [dict(boxes=torch.tensor([[12., 10., 50., 40.]]), labels=torch.tensor([1]), masks=masks)] * n


def _check_detector(name, **kwargs):
    torch.manual_seed(0)
    det = _mask_rcnn(name, **kwargs)
    randomize_batchnorm_(det.backbone.body)  # statistics as after pre-training, so folding is not trivial
    stats = {n: b.clone() for n, b in det.backbone.body.named_buffers() if 'running' in n}
    images = [torch.rand(3, 64, 64), torch.rand(3, 64, 64)]

    det.train()
    losses = det(images, _targets())
    assert set(losses) == {'loss_classifier', 'loss_box_reg', 'loss_mask', 'loss_objectness', 'loss_rpn_box_reg'}
    assert all(torch.isfinite(v) and v > 0 for v in losses.values())
    sum(losses.values()).backward()
    swapped = [m for m in det.backbone.body.modules() if isinstance(m, (RePaFFN, IFFN))]
    assert swapped and all(m.fc1.weight.grad is not None and m.fc1.weight.grad.abs().sum() > 0 for m in swapped)
    # freeze_bn_stats: the backbone's BatchNorm statistics did not move during the training step
    for n, b in det.backbone.body.named_buffers():
        if n in stats:
            torch.testing.assert_close(b, stats[n], rtol=0, atol=0)

    det.eval()
    with torch.no_grad():
        out = det(images)
    assert len(out) == 2 and set(out[0]) == {'boxes', 'labels', 'scores', 'masks'}
    n = out[0]['boxes'].shape[0]
    assert out[0]['masks'].shape == (n, 1, 64, 64) and out[0]['scores'].shape == (n,)

    # deploy: fold the backbone; its pyramid equals the training-form one in eval mode
    x = torch.rand(1, 3, 64, 64)
    folded = reparameterize(det.backbone)
    assert not any(isinstance(m, RePaFFN) for m in folded.modules())
    with torch.no_grad():
        ref, got = det.backbone(x), folded(x)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-4)
    return det


def test_mask_rcnn_with_repa_poolformer_backbone():
    _check_detector('repa_poolformer_s12')


def test_freeze_bn_stats_off_updates_statistics():
    backbone = FeaturePyramidBackbone('repa_poolformer_s12', out_channels=8, freeze_bn_stats=False).train()
    bn = next(m for m in backbone.body.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    before = bn.running_mean.clone()
    backbone(torch.randn(1, 3, 64, 64))
    assert not torch.equal(bn.running_mean, before)
    backbone.freeze_bn_stats = True
    backbone.train()
    assert not bn.training


@pytest.mark.slow
def test_mask_rcnn_with_iffn_swin_backbone():
    _check_detector('iffn_swin_tiny_patch4_window7_224', img_size=64, window_size=2)
