"""Tokenizers and sequence-classification models for GLUE fine-tuning, from local files only.

Nothing here downloads: every ``from_pretrained`` reads a local folder (``local_files_only=True``). A model
comes from a folder holding a Hugging Face ``config.json`` and its weights (a pretrained model the user brings),
from a ``config.json`` alone or a preset name (random initialization; the sizes of the models of AFBO's
Table 12 are presets), with ``transformers``' ``AutoModelForSequenceClassification`` either way.
A tokenizer comes from a local folder or ``tokenizer.json``, the model's folder, or is trained on the task's own
text (a WordPiece vocabulary, with the ``tokenizers`` package) for offline runs that have no pretrained one.
"""
import json
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

__all__ = ['PRESETS', 'GlueModelError', 'train_wordpiece', 'load_tokenizer', 'model_config', 'build_model',
           'has_weights', 'check_model_source', 'SPECIAL_TOKENS']

# random-init configurations by name: (transformers model_type, config arguments)
PRESETS: Dict[str, tuple] = {
    'bert-tiny': ('bert', dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)),
    'bert-base': ('bert', dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)),
    'bert-large': ('bert', dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096)),
    'openai-gpt': ('openai-gpt', dict(n_embd=768, n_layer=12, n_head=12, n_positions=512)),
    'gpt2': ('gpt2', dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
}

SPECIAL_TOKENS = ('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')
WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json', 'pytorch_model.bin',
                'pytorch_model.bin.index.json')


class GlueModelError(ValueError):
    """A model or tokenizer that cannot be built or loaded from what was given (the message says what to give)."""


def train_wordpiece(texts: Iterable[str], vocab_size: int):
    """A lower-casing BERT-style WordPiece tokenizer for ``texts`` (``[CLS] A [SEP] B [SEP]`` with segment ids), as
    a ``transformers`` fast tokenizer. Its vocabulary: the special tokens, every character seen (alone and as a
    ``##`` continuation, so no word is unknown) and the most frequent words (ties in alphabetical order) up to
    ``vocab_size`` tokens in all (more if the characters alone need more).

    The same texts always give the same vocabulary and ids. ``tokenizers``' own ``WordPieceTrainer`` does not:
    it breaks ties between equally frequent merges in hash-map order, so two trainings on one file differ, and
    so would two runs of one command. Normalization, pre-tokenization and the WordPiece model are the library's.
    """
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    normalizer, pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = Counter(word for text in texts
                    for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in words for c in word})
    vocab = [*SPECIAL_TOKENS, *chars, *('##' + c for c in chars)]
    known = set(vocab)
    ranked = sorted((w for w in words if w not in known), key=lambda w: (-words[w], w))
    vocab += ranked[:max(0, vocab_size - len(vocab))]
    tokenizer = Tokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)}, unk_token='[UNK]'))
    tokenizer.normalizer, tokenizer.pre_tokenizer, tokenizer.decoder = normalizer, pre_tokenizer, decoders.WordPiece()
    cls, sep = vocab.index('[CLS]'), vocab.index('[SEP]')
    tokenizer.post_processor = processors.TemplateProcessing(
        single='[CLS] $A [SEP]', pair='[CLS] $A [SEP] $B:1 [SEP]:1', special_tokens=[('[CLS]', cls), ('[SEP]', sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token='[UNK]', pad_token='[PAD]',
                                   cls_token='[CLS]', sep_token='[SEP]', mask_token='[MASK]',
                                   model_input_names=['input_ids', 'token_type_ids', 'attention_mask'])


def load_tokenizer(path: Path, flag: str = '--tokenizer'):
    """A tokenizer from a local folder (``save_pretrained`` layout) or a ``tokenizer.json`` file; one without a
    padding token pads with its end-of-text token (GPT-2's), one with neither is refused."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    path = Path(path)
    try:
        if path.is_dir():
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        elif path.is_file() and path.suffix == '.json':
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
            _name_special_tokens(tokenizer)
        else:
            raise GlueModelError(f'{flag} {path}: not a tokenizer folder or tokenizer.json file')
    except (OSError, ValueError, TypeError, KeyError, json.JSONDecodeError) as e:
        if isinstance(e, GlueModelError):
            raise
        detail = ' '.join(str(e).split())[:200]
        raise GlueModelError(f'{flag} {path}: cannot load a tokenizer there ({type(e).__name__}: {detail}); give a '
                             f'folder written by save_pretrained, a tokenizer.json, or --train-tokenizer N') from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise GlueModelError(f'{flag} {path}: the tokenizer has no padding and no end-of-text token, so batches '
                                 f'cannot be padded; add a [PAD] token or use --train-tokenizer N')
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _name_special_tokens(tokenizer) -> None:
    """Name the usual special tokens a bare tokenizer.json holds ([PAD], <pad>, ...), which it does not label."""
    vocab = tokenizer.get_vocab()
    for attr, names in (('pad_token', ('[PAD]', '<pad>')), ('unk_token', ('[UNK]', '<unk>')),
                        ('cls_token', ('[CLS]', '<s>')), ('sep_token', ('[SEP]', '</s>')),
                        ('eos_token', ('<|endoftext|>', '</s>')), ('mask_token', ('[MASK]', '<mask>'))):
        found = next((n for n in names if n in vocab), None)
        if found is not None:
            setattr(tokenizer, attr, found)


def check_model_source(source: str) -> None:
    """Refuse a ``--model`` that is neither a folder, a file nor a preset, before any data is read."""
    if not Path(source).exists() and source not in PRESETS:
        raise GlueModelError(f'--model {source}: not a folder, a config .json file or a preset; presets: '
                             f'{", ".join(PRESETS)} (random init; pretrained weights come as a local folder)')


def has_weights(folder: Path) -> bool:
    return any((Path(folder) / name).is_file() for name in WEIGHT_FILES)


def model_config(source: str, num_labels: int, label_names, model_args: Dict[str, Any], tokenizer):
    """(``transformers`` config, whether ``source`` holds pretrained weights) for ``--model source``."""
    from transformers import AutoConfig
    path = Path(source)
    pretrained = False
    try:
        if path.is_dir():
            if not (path / 'config.json').is_file():
                raise GlueModelError(f'--model {source}: a folder without config.json; give a Hugging Face model '
                                     f'folder (config.json and weights), a config .json file, or a preset '
                                     f'({", ".join(PRESETS)})')
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, **model_args)
            pretrained = has_weights(path)
        elif path.is_file():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True, **model_args)
        elif source in PRESETS:
            model_type, kwargs = PRESETS[source]
            config = AutoConfig.for_model(model_type, **{**kwargs, **model_args})
        else:
            check_model_source(source)
    except (OSError, ValueError, TypeError, KeyError) as e:
        if isinstance(e, GlueModelError):
            raise
        detail = ' '.join(str(e).split())[:200]
        raise GlueModelError(f'--model {source}: cannot read a model config ({type(e).__name__}: {detail})') from None
    config.num_labels = num_labels
    config.id2label = {i: name for i, name in enumerate(label_names)}
    config.label2id = {name: i for i, name in enumerate(label_names)}
    if not pretrained:  # a random-init model gets the tokenizer's vocabulary and its begin/end-of-text tokens
        if 'vocab_size' not in model_args:
            config.vocab_size = len(tokenizer)
        for key in ('bos_token_id', 'eos_token_id'):
            if hasattr(config, key) and key not in model_args:
                setattr(config, key, getattr(tokenizer, key))
    if len(tokenizer) > config.vocab_size:
        raise GlueModelError(f'the tokenizer has {len(tokenizer)} tokens but the model\'s embedding '
                             f'{config.vocab_size}; use the model\'s own tokenizer (or a smaller --train-tokenizer)')
    config.pad_token_id = tokenizer.pad_token_id  # GPT classifiers find each sequence's last token by it
    return config, pretrained


def build_model(config, weights: Optional[Path] = None):
    """``AutoModelForSequenceClassification`` for ``config``: the pretrained weights of the folder ``weights``, or
    random weights. A classification head the folder holds is loaded if it has the task's number of labels and
    newly initialized otherwise; any other weight whose shape the config changed is an error (it would be
    re-initialized silently)."""
    from transformers import AutoModelForSequenceClassification
    if weights is None:
        return AutoModelForSequenceClassification.from_config(config)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            str(weights), config=config, local_files_only=True, ignore_mismatched_sizes=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        detail = ' '.join(str(e).split())[:300]
        raise GlueModelError(f'--model {weights}: cannot load its weights ({type(e).__name__}: {detail})') from None
    body = sorted(key for key, *_ in info['mismatched_keys'] if key.startswith(model.base_model_prefix + '.'))
    if body:
        raise GlueModelError(f'--model {weights}: the config gives {", ".join(body[:4])} another shape than the '
                             f'pretrained weights; drop the --model-args that change sizes')
    return model
