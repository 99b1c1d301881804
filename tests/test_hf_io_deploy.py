"""Saving and loading swapped HF models, re-parameterization inside them, and ONNX export of a swapped BERT."""
import json

import numpy as np
import pytest
import torch

import vitblocks
import vitblocks.hf as H

from _hf_helpers import (PAD, bert, gpt2, llama, no_network, output_of, randomize_batchnorm_,  # noqa: F401
                         transformers, vit)


@pytest.mark.parametrize('builder,auto,name', [(gpt2, 'AutoModelForCausalLM', 'iffn'),
                                               (bert, 'AutoModel', 'afbo'), (llama, 'AutoModelForCausalLM', 'repa'),
                                               (vit, 'AutoModel', 'iffn')])
def test_save_and_load_round_trip(builder, auto, name, tmp_path):
    model = builder()
    H.swap_ffn(model, name, include=lambda q: not q.endswith('.0') or name != 'repa')
    H.swap_value_attention(model, 'swiglu')
    randomize_batchnorm_(model)
    model.eval()
    inputs = {'pixel_values': torch.randn(2, 3, 32, 32)} if builder is vit else \
        {'input_ids': torch.randint(2, 50, (2, 7))}
    with torch.no_grad():
        before = output_of(model, **inputs)
    H.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / 'config.json').read_text())
    assert config['vitblocks']['ffn'] == name and config['vitblocks']['value_attention']['value_act'] == 'swiglu'
    loaded = H.from_pretrained(getattr(transformers, auto), tmp_path)
    assert list(loaded.state_dict()) == list(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(output_of(loaded, **inputs), before, atol=0, rtol=0)


def test_transformers_alone_refuses_a_swapped_folder(tmp_path):
    model = gpt2()
    H.swap_ffn(model, 'iffn')
    H.save_pretrained(model, tmp_path)
    with pytest.raises(OSError, match='model.safetensors'):  # what a user without vitblocks sees
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert 'vitblocks.hf.from_pretrained' in (tmp_path / 'README.md').read_text()


def test_loading_needs_a_vitblocks_folder(tmp_path):
    gpt2().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match='vitblocks_model.safetensors'):
        H.from_pretrained(transformers.AutoModelForCausalLM, tmp_path)
    with pytest.raises(ValueError, match='no vitblocks swap'):
        H.save_pretrained(gpt2(), tmp_path / 'vanilla')


@pytest.mark.parametrize('name', ['iffn', 'repa', 'localvit'])
def test_reparameterize_keeps_outputs_and_cached_generation(name):
    model = gpt2()
    H.swap_ffn(model, name)
    randomize_batchnorm_(model)
    model.eval()
    deployed = vitblocks.reparameterize(model)
    ids = torch.randint(2, 50, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(output_of(deployed, input_ids=ids), output_of(model, input_ids=ids),
                                   atol=1e-5, rtol=0)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD)
        torch.testing.assert_close(deployed.generate(ids[:1, :3], **kw), model.generate(ids[:1, :3], **kw))
    block = deployed.transformer.h[0].mlp.block
    if name == 'repa':
        assert type(block).__name__ == 'RePaDeployedFFN'
    elif name == 'iffn':
        assert isinstance(block.spatial.bn, torch.nn.Identity)  # folded into the sequence conv
    assert type(model.transformer.h[0].mlp.block).__name__ != 'RePaDeployedFFN'  # the original is untouched


def _padded_batch():
    """Token ids (2, 8) and their attention mask: the second sequence padded after 5 tokens."""
    ids = torch.randint(2, 50, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return ids, mask


def test_reparameterize_a_padded_encoder_batch():
    model = bert()
    H.swap_ffn(model, 'iffn')
    randomize_batchnorm_(model)
    model.eval()
    deployed = vitblocks.reparameterize(model)
    ids, mask = _padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(output_of(deployed, input_ids=ids, attention_mask=mask),
                                   output_of(model, input_ids=ids, attention_mask=mask), atol=1e-5, rtol=0)


class _BertHidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


# torch.export notes that the pad-mask hook sets a tensor attribute while tracing; the mask is an input of the graph
@pytest.mark.filterwarnings('ignore:The tensor attribute .* was assigned during export')
def test_a_swapped_bert_exports_to_onnx(tmp_path):
    ort = pytest.importorskip('onnxruntime')
    model = bert()
    H.swap_ffn(model, 'iffn')
    randomize_batchnorm_(model)
    wrapped = _BertHidden(vitblocks.reparameterize(model)).eval()
    ids, mask = _padded_batch()
    path = tmp_path / 'bert.onnx'
    torch.onnx.export(wrapped, (ids, mask), str(path), input_names=['input_ids', 'attention_mask'],
                      output_names=['hidden'], dynamo=True, verbose=False)
    session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    for m in (mask, torch.ones_like(mask)):  # the pad masking is in the graph, not baked in for one mask
        got = session.run(None, {'input_ids': ids.numpy(), 'attention_mask': m.numpy()})[0]
        with torch.no_grad():
            want = wrapped(ids, m).numpy()
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_vision_models_get_the_blocks_deployed_forms():
    model = vit()
    H.swap_ffn(model, 'iffn')
    randomize_batchnorm_(model)
    model.eval()
    deployed = vitblocks.reparameterize(model)
    assert type(deployed.layers[0].mlp.block).__name__ == 'IFFNDeployed'
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(output_of(deployed, pixel_values=x), output_of(model, pixel_values=x),
                                   atol=1e-5, rtol=0)
