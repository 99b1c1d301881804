"""vitblocks.hf.swap_ffn: wiring in every supported family, every block, and the errors."""
import pytest
import torch

import vitblocks
import vitblocks.hf as H
from vitblocks.hf import families
from vitblocks.profile import count_params

from _hf_helpers import (DECODERS, ENCODERS, VISION, bert, gpt2, inputs_for, llama, no_network,  # noqa: F401
                         output_of, transformers, vit)

ALL = {**ENCODERS, **DECODERS, **VISION}


@pytest.mark.parametrize('family', list(ALL))
def test_dense_block_from_the_ffn_weights_reproduces_the_model(family):
    # mlp (swiglu for the gated LLaMA-style FFNs) warm-started from the model's own FFN: same function, so the
    # family's residual, norm and dropout placement and the GPT Conv1D transposition are checked to 1e-6
    model = ALL[family]().eval()
    inputs = inputs_for(family)
    with torch.no_grad():
        before = output_of(model, **inputs)
    name = 'swiglu' if family in ('llama', 'qwen2', 'mistral') else 'mlp'
    assert H.swap_ffn(model, name, warm_start_from_dense=True) == 2
    with torch.no_grad():
        after = output_of(model, **inputs)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def test_a_fresh_block_changes_the_model():  # the check above could not pass by leaving the FFN in place
    model = bert().eval()
    inputs = inputs_for('bert')
    with torch.no_grad():
        before = output_of(model, **inputs)
    H.swap_ffn(model, 'mlp')
    assert not torch.allclose(output_of(model, **inputs), before, atol=1e-3)
    assert type(model.encoder.layer[0].intermediate).__name__ == 'HFFeedForward'
    assert isinstance(model.encoder.layer[0].output.dense, torch.nn.Identity)


@pytest.mark.parametrize('builder,family', [(bert, 'bert'), (gpt2, 'gpt2'), (vit, 'vit')])
def test_every_block_swaps_in_and_trains(builder, family):
    inputs = inputs_for(family, batch=2, length=6)
    for name in H.list_hf_ffns():
        model = builder(**{'gpt2': {'n_layer': 1}}.get(family, {'num_hidden_layers': 1})).train()
        assert H.swap_ffn(model, name) == 1, name
        out = output_of(model, **inputs)
        assert out.shape[:2] == (2, 6) or family == 'vit', name
        out.float().pow(2).mean().backward()
        block = model.base_model.get_submodule(
            {'bert': 'encoder.layer.0.intermediate', 'gpt2': 'h.0.mlp', 'vit': 'layers.0.mlp'}[family]).block
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters()), name


@pytest.mark.parametrize('family', ['roberta', 'openai-gpt', 'llama', 'qwen2', 'mistral', 'deit'])
def test_the_spatial_blocks_in_the_other_families(family):
    inputs = inputs_for(family)
    for name in ('iffn', 'afbo', 'repa'):
        model = ALL[family]().eval()
        H.swap_ffn(model, name)
        assert torch.isfinite(output_of(model, **inputs)).all()


def test_sequence_convs_have_k_taps():
    counts = {}
    for k in (3, 5):
        model = bert()
        H.swap_ffn(model, 'iffn', kernel_size=k)
        conv = model.encoder.layer[0].intermediate.block.spatial.conv
        assert tuple(conv.weight.shape) == (64, 1, 1, k)
        counts[k] = count_params(model), H.count_macs(model, 16).total
    # 2 layers x 64 hidden channels x 2 more taps: parameters, and MACs at each of 16 tokens (k x k would be 16x)
    assert counts[5][0] - counts[3][0] == 2 * 64 * 2
    assert counts[5][1] - counts[3][1] == 2 * 64 * 2 * 16


def test_afbo_has_two_sequence_convs_per_layer():
    model = gpt2()
    H.swap_ffn(model, 'afbo', kernel_size=3)
    convs = [m for m in model.modules() if type(m).__name__ == 'SequenceConv']
    assert len(convs) == 4 and all(c.weight.shape[-2:] == (1, 3) for c in convs)


def test_vision_models_keep_their_grid_and_prefix_tokens():
    model = vit().eval()
    H.swap_ffn(model, 'iffn')
    layout = model.vitblocks_context
    assert layout.grid_size == (4, 4) and layout.num_prefix_tokens == 1
    model(pixel_values=torch.randn(1, 3, 48, 48), interpolate_pos_encoding=True)
    assert layout.grid_size == (6, 6)  # read from pixel_values on every call
    conv = model.layers[0].mlp.block.spatial.conv
    assert conv.kernel_size == (3, 3)


def test_include_selects_layers_and_counts():
    model = gpt2()
    assert H.swap_ffn(model, 'iffn', include=lambda q: q.endswith('.1')) == 1
    assert type(model.transformer.h[0].mlp).__name__ == 'GPT2MLP'
    assert model.config.vitblocks['layers'] == ['transformer.h.1']


def test_unknown_model_names_the_supported_layers():
    with pytest.raises(ValueError, match='BertLayer.*GPT2Block.*LlamaDecoderLayer'):
        H.swap_ffn(transformers.T5Model(transformers.T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                                              vocab_size=20)), 'iffn')


def test_options_it_cannot_honour_are_errors():
    with pytest.raises(ValueError, match='chunk_size_feed_forward'):
        H.swap_ffn(bert(chunk_size_feed_forward=4), 'iffn')
    with pytest.raises(ValueError, match='causal'):
        H.swap_ffn(gpt2(), 'iffn', padding='same')
    with pytest.raises(ValueError, match='running'):
        H.swap_ffn(gpt2(), 'iffn', batch_norm='batch')
    with pytest.raises(ValueError, match='pooling'):
        H.swap_ffn(bert(), 'afbo', spatial='maxpool')
    with pytest.raises(ValueError, match='unknown block'):
        H.swap_ffn(bert(), 'afbo_huge')
    with pytest.raises(ValueError, match='warm_start'):
        H.swap_ffn(bert(), 'iffn', warm_start_from_dense=True)
    with pytest.raises(ValueError, match='swiglu'):
        H.swap_ffn(llama(), 'mlp', warm_start_from_dense=True)
    with pytest.raises(ValueError, match='config.json'):
        H.swap_ffn(bert(), 'iffn', act_layer=torch.nn.SiLU)
    model = bert()
    H.swap_ffn(model, 'iffn')
    with pytest.raises(ValueError, match='already holds'):
        H.swap_ffn(model, 'afbo')


def test_sharded_models_are_refused_and_the_tp_plan_loses_the_ffn():
    model = llama()
    assert any('.mlp.' in k for k in model.config.base_model_tp_plan)
    H.swap_ffn(model, 'iffn')
    assert not any('.mlp.' in k for k in model.config.base_model_tp_plan)
    sharded = llama()
    sharded._tp_size = 2
    with pytest.raises(ValueError, match='tensor-parallel'):
        H.swap_ffn(sharded, 'iffn')


def test_the_family_activation_is_taken_over():
    model = gpt2()  # gelu_new: GELU's tanh approximation
    H.swap_ffn(model, 'iffn')
    assert model.transformer.h[0].mlp.block.act.base == 'gelu_tanh'
    model = llama()
    H.swap_ffn(model, 'mlp')
    assert isinstance(model.model.layers[0].mlp.block.act, torch.nn.SiLU)


def test_value_attention_in_each_family():
    for builder, family in [(bert, 'bert'), (gpt2, 'gpt2'), (llama, 'llama'), (vit, 'vit')]:
        model = builder().eval()
        inputs = inputs_for(family)
        with torch.no_grad():
            before = output_of(model, **inputs)
        assert H.swap_value_attention(model, 'identity') == 2  # W_V taken over: the same model
        torch.testing.assert_close(output_of(model, **inputs), before, atol=1e-6, rtol=0)
        model = builder().eval()
        n = count_params(model)
        H.swap_value_attention(model, 'swiglu')
        assert count_params(model) > n
        assert torch.isfinite(output_of(model, **inputs)).all()


def test_every_family_is_listed():
    listed = families.supported_layer_classes()
    for cls in ('BertLayer', 'RobertaLayer', 'GPT2Block', 'Block', 'LlamaDecoderLayer', 'Qwen2DecoderLayer',
                'MistralDecoderLayer', 'ViTLayer', 'DeiTLayer'):
        assert any(entry.endswith(': ' + cls) for entry in listed)
    assert set(vitblocks.list_ffns()) < set(H.list_hf_ffns())
