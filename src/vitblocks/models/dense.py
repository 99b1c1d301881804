"""Dense prediction: a vitblocks (or any timm) model as the backbone of a torchvision detector.

torchvision's ``FasterRCNN`` / ``MaskRCNN`` take a backbone module returning an ordered dict of
``(B, C, H, W)`` maps, all with ``backbone.out_channels`` channels. :class:`FeaturePyramidBackbone`
is timm's ``features_only`` model (:mod:`vitblocks.models.features`) plus torchvision's
``FeaturePyramidNetwork``; the only glue written here is the layout conversion (Swin's stages are
channels-last) and BatchNorm handling.

BatchNorm (RePa's ``BN_in`` / ``BN_hidden``, IFFN's depthwise-conv BN): a detection batch is one or
two large images, and a fine-tuned detector should keep the statistics its backbone was trained
with, as torchvision freezes ResNet's BatchNorm. With ``freeze_bn_stats=True`` (default) every
BatchNorm of the backbone stays in eval mode when the detector trains (mmdet's ``norm_eval``): it
normalizes with its running statistics and does not update them; its affine weights still train.
The unit then still folds exactly (``vitblocks.deploy.reparameterize``) before deployment.
"""
from collections import OrderedDict
from typing import Dict, Optional, Sequence

import timm
import torch
from timm.layers import Format
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

__all__ = ['FeaturePyramidBackbone']


class FeaturePyramidBackbone(nn.Module):
    """``timm.create_model(name, features_only=True)`` + FPN, as torchvision detectors expect.

    Args:
        model_name: a registered vitblocks (or timm) model.
        out_channels: FPN width (``backbone.out_channels``, read by torchvision's heads).
        out_indices: which backbone features feed the FPN (timm's ``out_indices``).
        freeze_bn_stats: keep the backbone's BatchNorms in eval mode while training (see module doc).
        **kwargs: passed to ``timm.create_model`` (``img_size=``, ``block_cfg=``, ...).
    """

    def __init__(self, model_name: str, out_channels: int = 256, out_indices: Optional[Sequence[int]] = None,
                 freeze_bn_stats: bool = True, **kwargs):
        super().__init__()
        if out_indices is not None:
            kwargs['out_indices'] = tuple(out_indices)
        self.body = timm.create_model(model_name, features_only=True, **kwargs)
        self.channels_last = getattr(self.body, 'output_fmt', Format.NCHW) == Format.NHWC
        self.fpn = FeaturePyramidNetwork(self.body.feature_info.channels(), out_channels,
                                         extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.freeze_bn_stats = freeze_bn_stats

    def train(self, mode: bool = True) -> 'FeaturePyramidBackbone':
        super().train(mode)
        if mode and self.freeze_bn_stats:
            for m in self.body.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        feats = self.body(x)
        if self.channels_last:
            feats = [f.permute(0, 3, 1, 2) for f in feats]  # (B, H, W, C) -> (B, C, H, W)
        return self.fpn(OrderedDict((str(i), f) for i, f in enumerate(feats)))
