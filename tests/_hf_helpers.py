"""Tiny random Hugging Face models for the vitblocks.hf tests, built offline (no hub access), and a guard that
fails any test which opens a network connection."""
import os
import socket

import pytest
import torch

os.environ.setdefault('HF_HUB_OFFLINE', '1')  # before transformers / huggingface_hub read it
transformers = pytest.importorskip('transformers')
transformers.logging.set_verbosity_error()

VOCAB = 50
PAD, EOS = 1, 1


def _guard(*args, **kwargs):
    raise AssertionError(f'a vitblocks.hf test tried to reach the network: {args[1:] if len(args) > 1 else args}')


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every connection attempt fails the test (the library must never download)."""
    monkeypatch.setattr(socket.socket, 'connect', _guard)
    monkeypatch.setattr(socket.socket, 'connect_ex', _guard)
    monkeypatch.setattr(socket, 'create_connection', _guard)


_TEXT = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=EOS, pad_token_id=PAD)


def bert(**kw):
    return transformers.BertModel(transformers.BertConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.,
        attention_probs_dropout_prob=0., **_TEXT), **kw}))


def roberta(**kw):
    return transformers.RobertaModel(transformers.RobertaConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.,
        attention_probs_dropout_prob=0., max_position_embeddings=40, **_TEXT), **kw}))


def gpt2(**kw):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0., embd_pdrop=0., attn_pdrop=0., **_TEXT), **kw}))


def openai_gpt(**kw):
    return transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(**{**dict(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0., embd_pdrop=0., attn_pdrop=0., **_TEXT), **kw}))


def llama(**kw):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        **_TEXT), **kw}))


def qwen2(**kw):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        **_TEXT), **kw}))


def mistral(**kw):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**{**dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        sliding_window=None, **_TEXT), **kw}))


def vit(**kw):
    return transformers.ViTModel(transformers.ViTConfig(**{**dict(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0., attention_probs_dropout_prob=0.), **kw}))


def deit(**kw):
    return transformers.DeiTModel(transformers.DeiTConfig(**{**dict(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        hidden_dropout_prob=0., attention_probs_dropout_prob=0.), **kw}))


ENCODERS = {'bert': bert, 'roberta': roberta}
DECODERS = {'gpt2': gpt2, 'openai-gpt': openai_gpt, 'llama': llama, 'qwen2': qwen2, 'mistral': mistral}
VISION = {'vit': vit, 'deit': deit}
CACHED_DECODERS = {k: v for k, v in DECODERS.items() if k != 'openai-gpt'}  # GPT-1 has no KV cache


def inputs_for(name: str, batch: int = 2, length: int = 7):
    if name in VISION:
        return {'pixel_values': torch.randn(batch, 3, 32, 32)}
    return {'input_ids': torch.randint(2, VOCAB, (batch, length))}


def output_of(model, **inputs) -> torch.Tensor:
    out = model(**inputs)
    return out.logits if hasattr(out, 'logits') else out.last_hidden_state


def randomize_batchnorm_(model) -> None:
    """Non-trivial BatchNorm statistics and affine (a default BN is an identity in eval mode and hides bugs)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
