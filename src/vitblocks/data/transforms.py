"""Transforms: timm's PIL pipeline (``create_transform``: RandomResizedCrop, RandAugment,
color jitter, random erasing) and a batched uint8-tensor pipeline for datasets decoded in memory.

The tensor pipeline does on a whole batch what the simple recipes need per sample (resize,
random crop with padding, flips, normalization, timm's random erasing), drawing its random
numbers from a generator the caller seeds, so a batch's augmentation is a pure function of
(seed, epoch, step) — which is what makes a resumed run match an uninterrupted one.

Grayscale: images are converted to the model's channel count (1 -> 3 by repeating, 3 -> 1 by
ITU-R 601 luma), so an RGB model trains on MNIST and a 1-channel model on grayscale CIFAR.
"""
import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .base import ImageDataset

__all__ = ['BatchTransform', 'build_pil_transform', 'dataset_mean_std', 'match_channels', 'PIL_ONLY_AUGMENTS']

LUMA = (0.299, 0.587, 0.114)
# augmentations only timm's PIL pipeline implements (the tensor pipeline refuses them)
PIL_ONLY_AUGMENTS = ('auto_augment', 'color_jitter', 'scale')


def match_channels(x: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, C, H, W) with C in {1, 3} -> (B, channels, H, W); uint8 stays uint8."""
    c = x.shape[1]
    if c == channels:
        return x
    if c == 1 and channels == 3:
        return x.expand(-1, 3, -1, -1)
    if c == 3 and channels == 1:
        w = torch.tensor(LUMA, dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
        y = (x.float() * w).sum(1, keepdim=True)
        return y.round_().to(torch.uint8) if x.dtype == torch.uint8 else y
    raise ValueError(f'cannot convert {c}-channel images to {channels} channels')


class BatchTransform:
    """uint8 ``(B, C, H, W)`` batch -> normalized float batch of ``input_size`` (C, H, W).

    Training adds, in this order: random crop of the (zero-)padded image (``crop_padding``
    pixels, the CIFAR-ResNet augmentation), horizontal / vertical flips with probability
    ``hflip`` / ``vflip``, then timm's ``RandomErasing`` (``reprob``) after normalization.
    Evaluation is timm's eval transform (``transforms_imagenet_eval``, crop mode 'center'): the
    image is resized, keeping its aspect ratio, so that it covers ``floor(size / crop_pct)`` (the
    shorter side for a square size), then the center ``size`` is cropped (torchvision's
    ``center_crop``, whose rounding puts an odd margin's extra pixel at the top/left).
    """

    def __init__(self, input_size: Sequence[int], mean: Sequence[float], std: Sequence[float], training: bool,
                 hflip: float = 0.0, vflip: float = 0.0, crop_padding: int = 0, interpolation: str = 'bilinear',
                 reprob: float = 0.0, remode: str = 'pixel', recount: int = 1, crop_pct: float = 1.0,
                 device: torch.device = torch.device('cpu')):
        if not 0 < crop_pct <= 1:
            raise ValueError(f'crop_pct={crop_pct}: expected a number in (0, 1]')
        self.channels, self.size = int(input_size[0]), (int(input_size[1]), int(input_size[2]))
        # evaluation resizes to cover this, then crops the center self.size (timm: floor(size / crop_pct))
        self.resize = self.size if training else tuple(math.floor(s / crop_pct) for s in self.size)
        if len(mean) != self.channels or len(std) != self.channels:
            raise ValueError(f'mean/std need {self.channels} values for {self.channels}-channel input, '
                             f'got {mean}, {std}')
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1) * 255  # normalize uint8 in one step
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1) * 255
        self.training, self.hflip, self.vflip, self.crop_padding = training, hflip, vflip, crop_padding
        self.interpolation = 'bicubic' if interpolation == 'bicubic' else 'bilinear'
        self.erase = None
        if training and reprob > 0:
            from timm.data.random_erasing import RandomErasing
            self.erase = RandomErasing(reprob, mode=remode, max_count=recount, device=str(device))

    def __call__(self, x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        x = match_channels(x, self.channels)
        if self.training and self.crop_padding:
            x = self._random_crop(x, generator)
        x = x.float()
        resized = self.size if self.training else eval_resize_shape(tuple(x.shape[-2:]), self.resize)
        if tuple(x.shape[-2:]) != resized:
            x = F.interpolate(x, size=resized, mode=self.interpolation, align_corners=False, antialias=True)
        if resized != self.size:  # (B, C, H', W') -> (B, C, H, W), the center as torchvision's CenterCrop takes it
            from torchvision.transforms.functional import center_crop
            x = center_crop(x, list(self.size))
        if self.training and (self.hflip or self.vflip):
            b = x.shape[0]
            flips = torch.rand(2, b, generator=generator).to(x.device, non_blocking=True)  # no stream sync
            if self.hflip:
                x = torch.where((flips[0] < self.hflip).view(b, 1, 1, 1), x.flip(-1), x)
            if self.vflip:
                x = torch.where((flips[1] < self.vflip).view(b, 1, 1, 1), x.flip(-2), x)
        x = (x - self.mean) / self.std
        if self.erase is not None:
            x = self.erase(x)
        return x

    def _random_crop(self, x: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.crop_padding
        padded = F.pad(x, (p, p, p, p))  # (B, C, H + 2p, W + 2p), zeros
        offsets = torch.randint(0, 2 * p + 1, (2, b), generator=generator).to(x.device, non_blocking=True)
        rows = offsets[0].view(b, 1) + torch.arange(h, device=x.device)  # (B, H)
        cols = offsets[1].view(b, 1) + torch.arange(w, device=x.device)  # (B, W)
        batch = torch.arange(b, device=x.device).view(b, 1, 1)
        out = padded.permute(0, 2, 3, 1)[batch, rows.view(b, h, 1), cols.view(b, 1, w)]  # (B, H, W, C)
        return out.permute(0, 3, 1, 2)  # (B, H, W, C) -> (B, C, H, W)


def eval_resize_shape(image: Tuple[int, int], cover: Tuple[int, int]) -> Tuple[int, int]:
    """(H, W) an ``image`` (H, W) is resized to before the center crop, as timm's eval transform does it:
    a square ``cover`` is the shorter side (torchvision's ``Resize(int)``: the longer side truncated), any
    other the smallest aspect-keeping size that covers it (timm's ``ResizeKeepRatio``: rounded)."""
    (h, w), (ch, cw) = image, cover
    if ch == cw:
        short, long = min(h, w), max(h, w)
        if short == ch:
            return h, w
        return (ch, int(ch * long / short)) if h <= w else (int(ch * long / short), ch)
    ratio = min(h / ch, w / cw)
    return round(h / ratio), round(w / ratio)


class _ConvertMode:
    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, img):
        return img if img.mode == self.mode else img.convert(self.mode)

    def __repr__(self):
        return f'ConvertMode({self.mode!r})'


def build_pil_transform(input_size: Sequence[int], mean: Sequence[float], std: Sequence[float], training: bool,
                        hflip: float = 0.5, vflip: float = 0.0, scale: Optional[Tuple[float, float]] = None,
                        ratio: Optional[Tuple[float, float]] = None, color_jitter: Optional[float] = None,
                        auto_augment: Optional[str] = None, interpolation: str = 'bicubic', reprob: float = 0.0,
                        remode: str = 'pixel', recount: int = 1, crop_pct: float = 1.0, crop_padding: int = 0,
                        uint8: bool = False):
    """timm's ``create_transform`` for PIL images, after converting them to the model's channels.

    Training without ``scale`` resizes to ``input_size`` (plus ``crop_padding`` random crop)
    instead of timm's RandomResizedCrop, the usual setting for MNIST/CIFAR-sized data; the rest
    follows timm's order and rules (flips, then RandAugment or else ``color_jitter``, as timm
    applies color jitter only without auto-augment).

    ``uint8``: end with a ``(C, H, W)`` uint8 tensor, neither normalized nor randomly erased
    (timm's ``use_prefetcher`` form); the loader does both on the device (``PILLoader(normalize=...)``).
    """
    from timm.data import create_transform
    from torchvision import transforms as T
    channels, size = int(input_size[0]), (int(input_size[1]), int(input_size[2]))
    mode = 'L' if channels == 1 else 'RGB'
    if training and scale is None:  # no RandomResizedCrop: resize (+ padded crop), flips, normalize, erase
        steps = [_ConvertMode(mode), T.Resize(size, interpolation=_interp(interpolation))]
        if crop_padding:
            steps.append(T.RandomCrop(size, padding=crop_padding))
        if hflip:
            steps.append(T.RandomHorizontalFlip(hflip))
        if vflip:
            steps.append(T.RandomVerticalFlip(vflip))
        if auto_augment:
            from timm.data.auto_augment import rand_augment_transform
            steps.append(rand_augment_transform(auto_augment, {'translate_const': int(size[0] * 0.45),
                                                               'img_mean': tuple(round(255 * m) for m in mean)}))
        elif color_jitter:  # brightness, contrast, saturation, as timm's create_transform
            steps.append(T.ColorJitter(color_jitter, color_jitter, color_jitter))
        if uint8:
            from timm.data.transforms import MaybePILToTensor
            return T.Compose(steps + [MaybePILToTensor()])
        steps += [T.ToTensor(), T.Normalize(mean, std)]
        if reprob:
            from timm.data.random_erasing import RandomErasing
            steps.append(RandomErasing(reprob, mode=remode, max_count=recount, device='cpu'))
        return T.Compose(steps)
    tf = create_transform(input_size=size, is_training=training, scale=scale, ratio=ratio, hflip=hflip, vflip=vflip,
                          color_jitter=color_jitter or 0.0, auto_augment=auto_augment, interpolation=interpolation,
                          mean=tuple(mean), std=tuple(std), re_prob=reprob, re_mode=remode, re_count=recount,
                          crop_pct=crop_pct, use_prefetcher=uint8)
    return T.Compose([_ConvertMode(mode), tf])


def _interp(name: str):
    from torchvision.transforms import InterpolationMode
    return InterpolationMode.BICUBIC if name == 'bicubic' else InterpolationMode.BILINEAR


@torch.no_grad()
def dataset_mean_std(ds: ImageDataset, channels: int,
                     max_images: int = 10000) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    """Per-channel mean and std of the images in [0, 1] (all of them when decoded in memory,
    else an evenly spaced sample of ``max_images``, summed one image at a time so memory stays
    at one image whatever the set's size; images of several sizes weigh by their pixel count)."""
    if ds.images is not None:
        chunks = ds.images.split(4096)
    else:
        from torchvision.transforms.functional import pil_to_tensor
        step = max(1, math.ceil(len(ds) / max_images))
        chunks = (pil_to_tensor(ds.load(i).convert('L' if channels == 1 else 'RGB'))[None]
                  for i in range(0, len(ds), step))  # (1, C, H, W), one at a time
    total = torch.zeros(channels, dtype=torch.float64)
    total_sq = torch.zeros(channels, dtype=torch.float64)
    count = 0
    for chunk in chunks:
        x = match_channels(chunk, channels).double() / 255
        total += x.sum((0, 2, 3))
        total_sq += (x * x).sum((0, 2, 3))
        count += x.numel() // channels
    mean = total / count
    std = (total_sq / count - mean * mean).clamp_min(0).sqrt()
    return tuple(round(v, 4) for v in mean.tolist()), tuple(round(v, 4) for v in std.tolist())
