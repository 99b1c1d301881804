"""Text in vitblocks.hf: pads never reach a real token, decoders stay causal in eval and training mode, BatchNorm
statistics leave pads out, and gradient checkpointing gives the same gradients."""
import copy

import pytest
import torch

import vitblocks.hf as H
from vitblocks.hf import hooks

from _hf_helpers import bert, gpt2, llama, no_network, output_of, roberta  # noqa: F401

SPATIAL = ('iffn', 'afbo', 'conv_glu', 'localvit', 'repa', 'convnext_block', 'locality')


def _right_padded(batch=3, length=9):
    ids = torch.randint(2, 50, (batch, length))
    mask = torch.ones_like(ids)
    lengths = [length, 5, 2][:batch]
    for i, n in enumerate(lengths):
        mask[i, n:] = 0
        ids[i, n:] = 1
    return ids, mask, lengths


@pytest.mark.parametrize('name', SPATIAL)
def test_each_sequence_of_a_padded_batch_gives_what_it_gives_alone(name):
    model = bert() if name != 'locality' else roberta()
    H.swap_ffn(model, name)
    model.eval()
    ids, mask, lengths = _right_padded()
    with torch.no_grad():
        batch = output_of(model, input_ids=ids, attention_mask=mask)
        for i, n in enumerate(lengths):
            alone = output_of(model, input_ids=ids[i:i + 1, :n])
            torch.testing.assert_close(batch[i, :n], alone[0], atol=1e-5, rtol=0)


def test_without_the_mask_padding_would_leak(monkeypatch):
    # the property above is not free: with the pad mask ignored, real tokens next to pads change
    monkeypatch.setattr(hooks, '_read_text_inputs', lambda context, *args: setattr(context, 'keep', None))
    model = bert()
    H.swap_ffn(model, 'iffn')
    model.eval()
    ids, mask, lengths = _right_padded()
    with torch.no_grad():
        batch = output_of(model, input_ids=ids, attention_mask=mask)
        alone = output_of(model, input_ids=ids[1:2, :lengths[1]])
    assert (batch[1, :lengths[1]] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize('name', ['iffn', 'repa', 'localvit'])
def test_batchnorm_training_statistics_leave_pads_out(name):
    model = bert()
    H.swap_ffn(model, name)
    model.train()
    ids, mask, lengths = _right_padded(batch=2)
    twin = copy.deepcopy(model)
    padded = output_of(model, input_ids=ids[1:], attention_mask=mask[1:])  # one sequence + 4 pads
    alone = output_of(twin, input_ids=ids[1:, :lengths[1]])  # the same sequence without them
    torch.testing.assert_close(padded[0, :lengths[1]], alone[0], atol=1e-5, rtol=0)
    for (key, a), b in zip(model.state_dict().items(), twin.state_dict().values()):
        if 'running' in key:
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=key)  # the statistics did not see the pads


@pytest.mark.parametrize('builder', [gpt2, llama])
@pytest.mark.parametrize('name', ['iffn', 'afbo', 'conv_glu', 'localvit', 'repa'])
def test_decoder_logits_do_not_depend_on_later_tokens(builder, name):
    model = builder()
    H.swap_ffn(model, name)
    ids = torch.randint(2, 50, (2, 10))
    later = ids.clone()
    later[:, 6] = (later[:, 6] + 1) % 50
    for mode in ('eval', 'train'):
        model.train(mode == 'train')
        state = copy.deepcopy(model.state_dict())  # training updates BatchNorm statistics: same start for both
        with torch.no_grad():
            a = output_of(model, input_ids=ids)
            model.load_state_dict(state)
            b = output_of(model, input_ids=later)
        torch.testing.assert_close(a[:, :6], b[:, :6], atol=0, rtol=0)
        assert (a[:, 6:] - b[:, 6:]).abs().max() > 0  # the changed token does reach its own and later positions


def test_causal_models_normalize_with_fixed_running_statistics():
    model = gpt2()
    H.swap_ffn(model, 'iffn')
    bn = model.transformer.h[0].mlp.block.spatial.bn
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
    before = bn.running_mean.clone()
    ids = torch.randint(2, 50, (2, 8))
    train_out = output_of(model.train(), input_ids=ids)
    assert torch.equal(bn.running_mean, before)
    torch.testing.assert_close(train_out, output_of(model.eval(), input_ids=ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize('builder,name', [(bert, 'iffn'), (gpt2, 'iffn'), (llama, 'afbo')])
def test_gradient_checkpointing_gives_the_same_gradients_on_a_padded_batch(builder, name):
    model = builder()
    H.swap_ffn(model, name)
    model.train()
    ckpt = copy.deepcopy(model)
    ckpt.activation_checkpointing_enable()  # transformers 5.24 name of gradient_checkpointing_enable
    ids, mask, _ = _right_padded()
    if builder is not bert:  # decoders: left padding, as in generation
        mask = mask.flip(1)
        ids = ids.flip(1)
    for m in (model, ckpt):
        output_of(m, input_ids=ids, attention_mask=mask, use_cache=False).pow(2).mean().backward() \
            if builder is not bert else output_of(m, input_ids=ids, attention_mask=mask).pow(2).mean().backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert any('.block.' in k for k in grads)
    for k, p in ckpt.named_parameters():
        if k in grads:
            torch.testing.assert_close(p.grad, grads[k], atol=1e-6, rtol=1e-5, msg=k)
    for (key, a), b in zip(model.state_dict().items(), ckpt.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=key)  # the recomputation updates no statistics


def test_a_sequence_layout_reads_its_grid_from_the_input():
    from vitblocks.layers import TokenLayout
    layout = TokenLayout(sequence=True)
    prefix, fmap = layout.split_tokens(torch.randn(2, 11, 8))
    assert prefix is None and fmap.shape == (2, 8, 1, 11)  # (B, L, C) -> (B, C, 1, L)
    assert TokenLayout(num_prefix_tokens=1, sequence=True).check_grid(11) == (1, 10)
    with pytest.raises(ValueError, match='sequence'):
        TokenLayout((4, 4), sequence=True)
