"""Load the authors' released checkpoints into vitblocks models: RePaViT and the IFFN DeiTs.

Both papers publish PyTorch weights in their own key layout. A vitblocks model that can hold
them gets a ``load_state_dict`` pre-hook (:func:`accept_authors_checkpoints`) which recognizes
the layout by its key names and rewrites it into ours before torch loads it. So the ordinary
timm paths work unchanged::

    timm.create_model('repa_prenorm_deit_base_patch16_224', checkpoint_path='RePaViT_Base.pth')
    timm.create_model('iffn_deit_tiny_patch16_224', checkpoint_path='iffn_tiny.pth')
    model.load_state_dict(torch.load(path)['model'])

timm's ``create_model(checkpoint_path=...)`` calls ``model.load_state_dict`` without a filter
(timm's ``checkpoint_filter_fn`` hooks only run for ``pretrained=True``), so a pre-hook on the
model is the one place every loading path passes through. :func:`checkpoint_filter_fn` is the
same conversion with timm's filter signature, for ``timm.models.load_checkpoint(filter_fn=...)``.

* ``repavit``: their ``RePaViT_{Tiny,Small,Base,Large,Huge}`` trained with ``--channel_idle
  --feature_norm=BatchNorm`` (Ackesnal/RePaViT, ``repavit.py``); recognized by
  ``blocks.N.attn.norm.*``; loads into ``repa_prenorm_*``.
* ``iffn_deit``: their ``deit_{tiny,small,base}_patch16_224`` (AMD-AIG-AIMA/AMD_IFFN,
  ``vision_transformer.py``); recognized by ``blocks.N.mlp.act1.move1.scale``; loads into
  ``iffn_deit_*``.

Renamed keys (everything else keeps its name)::

    RePaViT   blocks.N.attn.norm.*        -> blocks.N.norm1.*            (their pre-attention LayerNorm)
              blocks.N.mlp.norm1.*        -> blocks.N.mlp.norm_in.*      (BatchNorm1d(C), Eq. 3 BN(Y))
              blocks.N.mlp.norm2.*        -> blocks.N.mlp.norm_hidden.*  (BatchNorm1d(H), Eq. 3 BN(Y^Act))
    IFFN      blocks.N.mlp.conv1.*        -> blocks.N.mlp.fc1.*
              blocks.N.mlp.actJ.move1.scale / .bias -> blocks.N.mlp.act.alpha[J-1] / .gamma[J-1]  (Eq. 3 inside)
              blocks.N.mlp.actJ.move2.scale / .bias -> blocks.N.mlp.act.beta[J-1] / .theta[J-1]   (Eq. 3 outside)
              blocks.N.mlp.ln1.*          -> blocks.N.mlp.norm.*         (LayerNorm on the concat, Eq. 5)
              blocks.N.mlp.convKxK_dw.*   -> blocks.N.mlp.spatial.conv.*
              blocks.N.mlp.ln.*           -> blocks.N.mlp.spatial.bn.*   (their BatchNorm2d is named ``ln``)
              blocks.N.mlp.conv2.*        -> blocks.N.mlp.fc2.*
              blocks.N.mlp.ln2.*          -> blocks.N.mlp.norm_out.*

The files hold the training form (BatchNorms with running statistics); load them into the
training form and fold with ``vitblocks.deploy.reparameterize`` (``vitblocks convert --deploy``).
"""
import re
from typing import Dict, Optional

import torch
from torch import nn

from ..layers import IFFN, IFFNDeployed, RePaDeployedFFN, RePaFFN

__all__ = ['AUTHORS_LAYOUTS', 'AUTHORS_MODELS', 'AuthorsCheckpointError', 'accept_authors_checkpoints',
           'checkpoint_filter_fn', 'convert_authors_state_dict', 'detect_authors_layout']

AUTHORS_LAYOUTS = ('repavit', 'iffn_deit')
AUTHORS_MODELS = {  # the vitblocks models that compute each layout's function
    'repavit': 'repa_prenorm_{deit_tiny,deit_small,deit_base}_patch16_224, repa_prenorm_vit_{large,huge}_patch16_224',
    'iffn_deit': 'iffn_deit_{tiny,small,base}_patch16_224',
}

_DETECT = {
    'repavit': re.compile(r'blocks\.\d+\.attn\.norm\.weight$'),
    'iffn_deit': re.compile(r'blocks\.\d+\.mlp\.act1\.move1\.scale$'),
}
_RENAMES = {
    'repavit': [(re.compile(r'^(blocks\.\d+\.)attn\.norm\.'), r'\1norm1.'),
                (re.compile(r'^(blocks\.\d+\.mlp\.)norm1\.'), r'\1norm_in.'),
                (re.compile(r'^(blocks\.\d+\.mlp\.)norm2\.'), r'\1norm_hidden.')],
    'iffn_deit': [(re.compile(r'^(blocks\.\d+\.mlp\.)conv1\.'), r'\1fc1.'),
                  (re.compile(r'^(blocks\.\d+\.mlp\.)ln1\.'), r'\1norm.'),
                  (re.compile(r'^(blocks\.\d+\.mlp\.)conv\d+x\d+_dw\.'), r'\1spatial.conv.'),
                  (re.compile(r'^(blocks\.\d+\.mlp\.)ln\.'), r'\1spatial.bn.'),
                  (re.compile(r'^(blocks\.\d+\.mlp\.)conv2\.'), r'\1fc2.'),
                  (re.compile(r'^(blocks\.\d+\.mlp\.)ln2\.'), r'\1norm_out.')],
}
# their MyACT: move2(GELU(move1(x))) with move = x * scale + bias, i.e. Eq. 3 with these names
_AGELU = {('move1', 'scale'): 'alpha', ('move1', 'bias'): 'gamma', ('move2', 'scale'): 'beta',
          ('move2', 'bias'): 'theta'}
_AGELU_KEY = re.compile(r'^(blocks\.\d+\.mlp\.)act(\d+)\.(move[12])\.(scale|bias)$')


class AuthorsCheckpointError(ValueError):
    """An authors' checkpoint that does not fit the model it is loaded into."""


def detect_authors_layout(state_dict: Dict[str, torch.Tensor]) -> Optional[str]:
    """``'repavit'``, ``'iffn_deit'`` or ``None`` (not an authors' layout: ours, or anything else)."""
    for layout, pattern in _DETECT.items():
        if any(pattern.match(k) for k in state_dict):
            return layout
    return None


def _collision(first: str, second: str, ours: str) -> AuthorsCheckpointError:
    return AuthorsCheckpointError(
        f"the checkpoint holds both {first!r} and {second!r}, which are the same tensor ({ours!r} in vitblocks' "
        f"layout): it mixes the authors' key names with ours; keep one of the two")


def _rename(state_dict: Dict[str, torch.Tensor], layout: str) -> Dict[str, torch.Tensor]:
    out, source = {}, {}  # source: our key -> the checkpoint key it came from
    for key, value in state_dict.items():
        new = key
        for pattern, repl in _RENAMES[layout]:
            new, n = pattern.subn(repl, key)
            if n:
                break
        if new in out:  # one of the two silently overwrote the other
            raise _collision(source[new], key, new)
        out[new], source[new] = value, key
    return out


def _stack_agelu(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Their N ``MyACT`` modules (``(1, 1, C)`` scale/bias each) -> our stacked ``(N, C)`` parameters."""
    out, parts = {}, {}
    for key, value in state_dict.items():
        m = _AGELU_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        prefix, j, move, kind = m.groups()
        parts.setdefault((prefix, _AGELU[move, kind]), {})[int(j)] = value.reshape(-1)  # (1, 1, C) -> (C,)
    for (prefix, name), copies in parts.items():
        if sorted(copies) != list(range(1, len(copies) + 1)):
            raise AuthorsCheckpointError(f'{prefix}act*: expected act1..actN, found act{sorted(copies)}')
        if f'{prefix}act.{name}' in out:
            move, kind = next(k for k, v in _AGELU.items() if v == name)
            raise _collision(f'{prefix}act{min(copies)}.{move}.{kind}', f'{prefix}act.{name}', f'{prefix}act.{name}')
        out[f'{prefix}act.{name}'] = torch.stack([copies[j] for j in sorted(copies)])  # N x (C,) -> (N, C)
    return out


def _check_model(model: nn.Module, layout: str) -> None:
    """Fail early, with the fix, where the model cannot compute the authors' function."""
    name = 'RePaViT' if layout == 'repavit' else 'IFFN DeiT'
    mlp = model.blocks[0].mlp if len(getattr(model, 'blocks', ())) else None
    if isinstance(mlp, (RePaDeployedFFN, IFFNDeployed)):
        raise AuthorsCheckpointError(
            f"this is an authors' {name} checkpoint, the training form (BatchNorm statistics); the model is built in "
            f'deploy form: build it without block_cfg deploy=True, load, then vitblocks.deploy.reparameterize '
            f'(or `vitblocks convert --deploy`)')
    if not isinstance(mlp, RePaFFN if layout == 'repavit' else IFFN):
        raise AuthorsCheckpointError(f"this is an authors' {name} checkpoint; load it into one of "
                                     f'{AUTHORS_MODELS[layout]}')
    if layout == 'repavit' and (isinstance(model.norm_pre, nn.Identity) or model.blocks[0].norm1.eps != 1e-5):
        arch = getattr(model, 'pretrained_cfg', {}).get('architecture', '') or 'this model'
        hint = arch.replace('repa_', 'repa_prenorm_', 1) if arch.startswith('repa_') else 'repa_prenorm_<size>'
        raise AuthorsCheckpointError(
            f"this is an authors' RePaViT checkpoint: their ViTs are pre-norm (norm_pre after the position "
            f'embedding, bias-free patch embedding) with eps-1e-5 LayerNorms before attention, which {arch} is '
            f'not; build {hint} instead')
    if layout == 'iffn_deit' and (getattr(model, 'cls_token', None) is not None
                                  or not isinstance(model.fc_norm, nn.Identity)
                                  or not getattr(mlp.norm, 'eps', None) == getattr(mlp.norm_out, 'eps', None) == 1e-5):
        raise AuthorsCheckpointError(
            "the authors' IFFN DeiT has no class token, applies the final LayerNorm to every token before "
            'averaging (class_token=False, global_pool="avg", fc_norm=False) and uses eps-1e-5 LayerNorms in the '
            'IFFN, as iffn_deit_* are built; this model differs')


def convert_authors_state_dict(state_dict: Dict[str, torch.Tensor], model: Optional[nn.Module] = None,
                               layout: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Rewrite an authors' state dict into vitblocks keys (a new dict; tensors are not copied).

    Args:
        state_dict: their ``checkpoint['model']`` (or ``['model_ema']``), DDP prefixes removed.
        model: the model it will load into; checked to compute the authors' function (pre-norm for
            RePaViT, norm-then-average head for IFFN) and to be in training form.
        layout: one of :data:`AUTHORS_LAYOUTS`; detected from the key names by default.

    Returns:
        The converted dict; a state dict in no authors' layout is returned unchanged.
    """
    layout = layout or detect_authors_layout(state_dict)
    if layout is None:
        return dict(state_dict)
    if layout not in AUTHORS_LAYOUTS:
        raise ValueError(f'unknown authors\' layout {layout!r}; known: {", ".join(AUTHORS_LAYOUTS)}')
    if layout == 'repavit' and any(re.match(r'blocks\.\d+\.mlp\.norm\.weight$', k) for k in state_dict):
        raise AuthorsCheckpointError(
            'this RePaViT checkpoint was trained with --feature_norm=LayerNorm (blocks.N.mlp.norm): it cannot be '
            're-parameterized and is not a RePa model; use the authors\' BatchNorm checkpoints')
    if model is not None:
        _check_model(model, layout)
    out = _rename(state_dict, layout)
    return _stack_agelu(out) if layout == 'iffn_deit' else out


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """timm's filter signature: ``timm.models.load_checkpoint(model, path, filter_fn=checkpoint_filter_fn)``."""
    return convert_authors_state_dict(state_dict, model)


def _authors_checkpoint_pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                 unexpected_keys, error_msgs) -> None:
    """``load_state_dict`` pre-hook: convert an authors' layout in place (torch loads from a copy)."""
    keys = [k for k in state_dict if k.startswith(prefix)]
    own = {k[len(prefix):]: state_dict[k] for k in keys}
    if detect_authors_layout(own) is None:
        return
    converted = convert_authors_state_dict(own, module)
    for k in keys:
        del state_dict[k]
    state_dict.update({prefix + k: v for k, v in converted.items()})


def accept_authors_checkpoints(model: nn.Module) -> nn.Module:
    """Let ``model.load_state_dict`` (and so ``timm.create_model(checkpoint_path=...)``) take the
    authors' key layouts; states in our layout load as before. Returns ``model``."""
    model.register_load_state_dict_pre_hook(_authors_checkpoint_pre_hook)
    model.accepts_authors_checkpoints = True  # survives copy and pickle, unlike a look into torch's hook dicts
    return model
