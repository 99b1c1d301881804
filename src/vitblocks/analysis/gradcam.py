"""Grad-CAM maps of the last block (AFBO Figs. 3-4: Swin-T vs Swin-T+AFBO, 12th block), computed
with the maintained ``grad-cam`` package; this module only says, per timm family, which layer
to read and how to turn its output into the ``(B, C, H, W)`` map Grad-CAM expects.

Target layer: the output of the last block, whose tokens the head averages (the CAM of a
global-average-pooled network); for models with prefix tokens, ``norm1`` of the last block
instead (grad-cam's ViT recipe: the last block's output reaches a class-token head only through
the class token, so its patch tokens get no gradient). Layouts:

| family | layer output | reshape |
| --- | --- | --- |
| ViT/DeiT (and vitblocks variants) | ``(B, P + H*W, C)`` | drop P prefix tokens, grid from ``patch_embed.grid_size`` |
| MLP-Mixer | ``(B, H*W, C)`` | grid from ``stem.grid_size`` |
| Swin | ``(B, H, W, C)`` | channels to dim 1 |
| PoolFormer (MetaFormer) | ``(B, C, H, W)`` | none |
"""
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from .components import find_blocks
from .figures import png_figure

__all__ = ['gradcam_target', 'gradcam_maps', 'plot_gradcam']


def _token_grid(model: nn.Module) -> Tuple[int, int]:
    embed = getattr(model, 'patch_embed', None) or getattr(model, 'stem', None)  # MlpMixer calls it stem
    grid = getattr(embed, 'grid_size', None)
    if grid is None:
        raise ValueError(f'{type(model).__name__} has no patch_embed/stem.grid_size; '
                         'cannot lay its tokens out as a map')
    return int(grid[0]), int(grid[1])


def gradcam_target(model: nn.Module) -> Tuple[nn.Module, Optional[Callable[[torch.Tensor], torch.Tensor]]]:
    """``(layer, reshape_transform)`` for Grad-CAM on ``model`` (see the module docstring)."""
    name, block = find_blocks(model)[-1]
    prefix = int(getattr(model, 'num_prefix_tokens', 0))
    layer = getattr(block, 'norm1', None) if prefix else block
    if not isinstance(layer, nn.Module):
        raise ValueError(f'{name} ({type(block).__name__}) has no norm1 to read Grad-CAM activations from')
    if name.startswith('stages.'):  # PoolFormer: already (B, C, H, W)
        return layer, None
    if name.startswith('layers.'):  # Swin: (B, H, W, C)
        return layer, lambda t: t.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)
    h, w = _token_grid(model)

    def tokens_to_map(t: torch.Tensor) -> torch.Tensor:
        if t.shape[1] != prefix + h * w:
            raise ValueError(f'{t.shape[1]} tokens do not match {prefix} prefix tokens + a {h}x{w} grid; '
                             f'give images of the size the model was built for')
        return t[:, prefix:].reshape(t.shape[0], h, w, t.shape[2]).permute(0, 3, 1, 2)  # (B, P+HW, C) -> (B, C, H, W)
    return layer, tokens_to_map


def gradcam_maps(model: nn.Module, images: torch.Tensor, targets: Optional[Sequence[int]] = None) -> np.ndarray:
    """Grad-CAM maps ``(B, H, W)`` in [0, 1] at the input's size, for class ``targets[b]`` of image b
    (default: the model's prediction). Eval mode; the model is left as it was."""
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
    layer, reshape = gradcam_target(model)
    was_training = model.training
    model.eval()
    try:
        if targets is None:
            with torch.no_grad():
                targets = model(images).argmax(-1).tolist()
        if len(targets) != images.shape[0]:
            raise ValueError(f'{len(targets)} targets for {images.shape[0]} images')
        with GradCAM(model=model, target_layers=[layer], reshape_transform=reshape) as cam:
            return cam(input_tensor=images, targets=[ClassifierOutputTarget(int(c)) for c in targets])
    finally:
        model.train(was_training)


def plot_gradcam(images: torch.Tensor, maps: Dict[str, np.ndarray], path: Union[str, Path],
                 titles: Optional[Sequence[str]] = None) -> Path:
    """One row per image: the image, then each model's map over it. ``images``: ``(B, C, H, W)`` in
    [0, 1] (un-normalized); ``maps``: model label -> ``(B, H, W)``."""
    b = images.shape[0]
    cols = 1 + len(maps)
    pics = images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()  # (B, C, H, W) -> (B, H, W, C)
    with png_figure(path, dpi=80, nrows=b, ncols=cols, figsize=(1.9 * cols, 1.9 * b), squeeze=False) as (_, axes):
        for i in range(b):
            pic = pics[i, ..., 0] if pics.shape[-1] == 1 else pics[i]
            axes[i, 0].imshow(pic, cmap='gray' if pic.ndim == 2 else None)
            axes[i, 0].set_title(titles[i] if titles else 'image', fontsize=7)
            for j, (label, m) in enumerate(maps.items(), start=1):
                axes[i, j].imshow(pic, cmap='gray' if pic.ndim == 2 else None)
                axes[i, j].imshow(m[i], cmap='jet', alpha=0.5, vmin=0, vmax=1)
                if i == 0:
                    axes[i, j].set_title(label, fontsize=7)
        for ax in axes.flat:
            ax.axis('off')
    return Path(path)
