"""The vitblocks FFN swap of a GLUE run (``--ffn NAME`` with ``--block-cfg``), and writing its final model.

The swap itself is ``vitblocks.hf.swap_ffn``; this module only calls it with the run's settings, turns its errors
into one-line ones and saves a swapped model with ``vitblocks.hf.save_pretrained`` (the swap recorded in the
config, so ``vitblocks.hf.from_pretrained`` rebuilds it).
"""
from pathlib import Path
from typing import Any, Dict

from torch import nn

from ..experiments.config import ConfigError

__all__ = ['apply_swap', 'save_model']


def _hf():
    try:
        from .. import hf
    except ImportError as e:
        raise ConfigError(f'--ffn needs vitblocks.hf and transformers (pip install vitblocks[hf]): {e}') from None
    return hf


def apply_swap(model: nn.Module, ffn: str, block_cfg: Dict[str, Any], warm_start: bool = False) -> int:
    """Swap ``ffn`` (with ``block_cfg``) into every FFN of ``model``; returns how many were replaced.
    ``warm_start``: the blocks take the replaced FFNs' weights (``vitblocks.hf.warm_start`` says which can)."""
    hf = _hf()
    try:
        return hf.swap_ffn(model, ffn, warm_start_from_dense=warm_start, **block_cfg)
    except (TypeError, ValueError, KeyError) as e:
        cfg = ' '.join(f'{k}={v}' for k, v in block_cfg.items())
        raise ConfigError(f'--ffn {ffn}{" --block-cfg " + cfg if cfg else ""}{" --warm-start" * warm_start}: '
                          f'cannot swap it into '
                          f'{type(model).__name__}: {" ".join(str(e).split())[:300]}') from None


def save_model(model: nn.Module, tokenizer, folder: Path, swapped: bool) -> None:
    """The final weights and the tokenizer as a Hugging Face folder (``from_pretrained`` reads it; a swapped
    model through ``vitblocks.hf.from_pretrained``)."""
    if swapped:
        _hf().save_pretrained(model, str(folder))
    else:
        model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
