"""Generation with a cache: the last k - 1 inputs of each causal conv travel with the model's cache, so cached
decoding gives the tokens and logits of uncached decoding."""
import pytest
import torch

import vitblocks.hf as H

from _hf_helpers import CACHED_DECODERS, PAD, gpt2, llama, no_network, openai_gpt  # noqa: F401

K = 3  # the taps of every conv below


def _model(builder, name):
    model = builder()
    H.swap_ffn(model, name, **({'kernel_size': K} if name != 'repa' else {}))
    return model.eval()


def _greedy(model, ids, mask, use_cache, **kw):
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=use_cache,
                          pad_token_id=PAD, **kw)


@pytest.mark.parametrize('family,name', [(f, 'afbo') for f in CACHED_DECODERS] + [('gpt2', 'iffn')])
def test_prefill_then_single_steps_gives_the_full_forward_logits(family, name):
    model = _model(CACHED_DECODERS[family], name)
    ids = torch.randint(2, 50, (2, 10))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :4], use_cache=True)
        steps, cache = [out.logits], out.past_key_values
        for start, stop in ((4, 5), (5, 8), (8, 9), (9, 10)):  # single tokens and a chunk of 3
            out = model(input_ids=ids[:, start:stop], cache=cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize('builder,name', [(gpt2, 'iffn'), (gpt2, 'conv_glu'), (gpt2, 'repa'), (llama, 'afbo'),
                                          (llama, 'convnext_block')])
def test_greedy_generation_with_the_cache_equals_without(builder, name):
    model = _model(builder, name)
    ids = torch.randint(2, 50, (1, 9))
    with torch.no_grad():
        for length in (1, K - 1, K, 9):  # shorter than the kernel, its state exactly, longer
            prompt = ids[:, :length]
            mask = torch.ones_like(prompt)
            torch.testing.assert_close(_greedy(model, prompt, mask, True), _greedy(model, prompt, mask, False))


@pytest.mark.parametrize('builder', [gpt2, llama])
def test_a_left_padded_batch_generates_the_same_with_and_without_the_cache(builder):
    model = _model(builder, 'afbo')
    ids = torch.randint(2, 50, (2, 6))
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = PAD, 0  # a prompt of 3 tokens, left-padded to 6
    with torch.no_grad():
        cached = _greedy(model, ids, mask, True)
        torch.testing.assert_close(cached, _greedy(model, ids, mask, False))
        if builder is llama:  # rotary positions: a left-padded prompt generates what it generates alone
            torch.testing.assert_close(cached[0, 3:], _greedy(model, ids[:1, 3:], mask[:1, 3:], True)[0])


def test_beam_search_reorders_the_conv_state():
    model = _model(gpt2, 'iffn')
    ids = torch.randint(2, 50, (2, 4))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(_greedy(model, ids, mask, True, num_beams=3),
                                   _greedy(model, ids, mask, False, num_beams=3))


def test_a_cache_it_cannot_follow_is_an_error():
    model = _model(gpt2, 'iffn')
    ids = torch.randint(2, 50, (1, 6))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        with pytest.raises(NotImplementedError, match='cropped'):
            cache.crop(4)  # assisted decoding
        vanilla = gpt2().eval()
        foreign = vanilla(input_ids=ids, use_cache=True).past_key_values  # filled without vitblocks
        with pytest.raises(RuntimeError, match='fresh cache'):
            model(input_ids=ids[:, :1], cache=foreign, use_cache=True)


def test_gpt1_has_no_cache_and_stays_causal_in_generation():
    model = _model(openai_gpt, 'iffn')
    ids = torch.randint(2, 50, (1, 4))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=PAD)
        full = model(input_ids=out).logits
    torch.testing.assert_close(out[0, 4:], full[0, 3:-1].argmax(-1))


def test_a_bert_decoder_is_causal_and_caches_its_convs():
    from _hf_helpers import transformers
    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, is_decoder=True, bos_token_id=0, eos_token_id=1,
                                     pad_token_id=PAD, hidden_dropout_prob=0., attention_probs_dropout_prob=0.)
    model = transformers.BertLMHeadModel(config)
    H.swap_ffn(model, 'afbo')
    assert model.vitblocks_context.causal
    model.eval()
    ids = torch.randint(2, 50, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(_greedy(model, ids, torch.ones_like(ids), True),
                                   _greedy(model, ids, torch.ones_like(ids), False))
