"""Where the blocks and their parts are in the timm families vitblocks supports, by attribute name.

timm names the parts of a MetaFormer-style model the same way across families, so the analyses
find them without knowing the class: ViT/DeiT ``blocks[i].{norm1, attn, norm2, mlp}``, Swin
``layers[s].blocks[i]`` (same names, ``layers[s].downsample`` merges patches), PoolFormer
``stages[s].blocks[i].{norm1, token_mixer, norm2, mlp}`` (``stem``, ``stages[s].downsample``),
MLP-Mixer ``blocks[i].{norm1, mlp_tokens, norm2, mlp_channels}``. vitblocks variants keep these
names (surgery swaps the module, not the name), so RePa's FFN (with its BatchNorm and shortcut,
``x = unit(x)``) is found as ``mlp`` too.
"""
import re
from typing import Dict, List, Optional, Tuple

from torch import nn

__all__ = ['COMPONENTS', 'component_of', 'component_modules', 'find_blocks', 'ffn_modules', 'eval_forward_with_hooks']

COMPONENTS = ('patch embed', 'token mixer', 'ffn', 'norm', 'head')

_BY_NAME: Dict[str, str] = {
    'patch_embed': 'patch embed', 'stem': 'patch embed', 'downsample': 'patch embed',
    'attn': 'token mixer', 'token_mixer': 'token mixer', 'mlp_tokens': 'token mixer',
    'mlp': 'ffn', 'mlp_channels': 'ffn',
    'norm1': 'norm', 'norm2': 'norm', 'norm': 'norm', 'fc_norm': 'norm', 'norm_pre': 'norm',
    'head': 'head',
}
_BLOCK_PATH = re.compile(r'^(blocks\.\d+|layers\.\d+\.blocks\.\d+|stages\.\d+\.blocks\.\d+)$')


def component_of(qualified_name: str) -> Optional[str]:
    """The component a module named ``qualified_name`` (e.g. ``blocks.3.mlp``) is, or None."""
    return _BY_NAME.get(qualified_name.rsplit('.', 1)[-1])


def component_modules(model: nn.Module) -> List[Tuple[str, str, nn.Module]]:
    """``(name, component, module)`` for the outermost modules that are a component (a component's
    own sub-modules, e.g. the norm inside a PoolFormer head, are part of it, not counted again)."""
    found, taken = [], []
    for name, module in model.named_modules():
        if any(name.startswith(t + '.') for t in taken):
            continue
        comp = component_of(name) if name else None
        if comp is None or isinstance(module, nn.Identity):
            continue
        if comp == 'head' and isinstance(module, nn.Sequential):  # PoolFormer calls head.norm, head.fc, ... itself
            found += [(f'{name}.{n}', comp, m) for n, m in module.named_children() if not isinstance(m, nn.Identity)]
        else:
            found.append((name, comp, module))
        taken.append(name)
    return found


def find_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, block)`` of every transformer block in forward order (ViT, Swin, PoolFormer, Mixer)."""
    blocks = [(n, m) for n, m in model.named_modules() if _BLOCK_PATH.match(n)]
    if not blocks:
        raise ValueError(f'{type(model).__name__} has no blocks.N, layers.S.blocks.N or stages.S.blocks.N '
                         f'modules; the analyses support timm ViT/DeiT, Swin, PoolFormer and MLP-Mixer models')
    return blocks


def ffn_modules(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, ffn)`` of the FFN (channel MLP) of every block, in forward order."""
    return [(f'{n}.{attr}', getattr(b, attr)) for n, b in find_blocks(model)
            for attr in ('mlp', 'mlp_channels') if isinstance(getattr(b, attr, None), nn.Module)]


def eval_forward_with_hooks(model: nn.Module, inputs, handles):
    """One eval-mode forward of ``model`` on ``inputs`` with the hooks ``handles`` installed; afterwards,
    whatever happens, the hooks are removed and the model's training mode is restored."""
    was_training = model.training
    try:
        return model.eval()(inputs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
