"""``grad_checkpointing=true``: timm's activation checkpointing in a training run. Each block's forward runs again in
the backward pass, and the run's result is unchanged (dropout and drop path included: the recomputation replays the
RNG). A training step here is a 16-wide model on 8x8 synthetic images, one CPU thread."""
import re

import pytest
import torch
from torch import nn

from vitblocks.experiments import merge
from vitblocks.experiments.config import ConfigError
from vitblocks.experiments.engine import Trainer
from vitblocks.profile import fixed_threads
from _train_helpers import TINY_VIT, tiny_dataset


@pytest.fixture(autouse=True, scope='module')
def _one_thread():
    with fixed_threads(1):
        yield


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    return tiny_dataset(tmp_path_factory.mktemp('data'), n_train=32, n_test=8, size=8)


def _cfg(data, out, name, **kw):
    base = dict(model='iffn_deit_tiny_patch16_224', data=str(data), epochs=1, max_steps=3, batch_size=8,
                model_kwargs={**TINY_VIT, 'depth': 2}, drop_path_rate=0.2, drop_rate=0.1, mean='dataset',
                std='dataset', progress='none', log_interval=1, output=str(out), name=name, tensorboard=False,
                threads=1)
    return merge({**base, **kw})


def _block_forwards(trainer):
    """Count the forwards of every block: once per step without checkpointing, twice with it (a wrapped
    ``forward``: torch runs the recomputation without the module's forward hooks)."""
    calls = []
    for blk in trainer.model.blocks:
        def counted(*args, _forward=blk.forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)
        blk.forward = counted
    return calls


def test_a_checkpointed_run_recomputes_each_block_and_ends_with_the_same_weights(data, tmp_path):
    plain = Trainer(_cfg(data, tmp_path, 'plain'))
    plain_calls = _block_forwards(plain)
    plain.fit()
    ckpt = Trainer(_cfg(data, tmp_path, 'ckpt', grad_checkpointing=True))
    assert ckpt.model.grad_checkpointing
    ckpt_calls = _block_forwards(ckpt)
    ckpt.fit()
    # 3 steps x 2 blocks, plus the evaluation's forwards (no recomputation there: no backward)
    evaluation = len(plain_calls) - 3 * 2
    assert len(ckpt_calls) == len(plain_calls) + 3 * 2 and evaluation > 0
    for (name, a), b in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_grad_checkpointing_can_change_on_resume(data, tmp_path):
    """It changes how a step runs, not what it computes, so a run may be resumed with it switched (e.g. on GPUs
    with less memory) and ends where the uninterrupted run ends."""
    whole = Trainer(_cfg(data, tmp_path, 'whole', max_steps=4)).fit()
    first = Trainer(_cfg(data, tmp_path, 'split', max_steps=2)).fit()
    resumed = Trainer(_cfg(data, tmp_path, 'split', max_steps=4, grad_checkpointing=True),
                      resume=first.run_dir / 'last.pth')
    assert resumed.model.grad_checkpointing
    end = resumed.fit()
    assert end.global_step == whole.global_step == 4
    a = torch.load(whole.run_dir / 'last.pth', weights_only=False)['model']
    b = torch.load(end.run_dir / 'last.pth', weights_only=False)['model']
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_a_model_without_checkpointing_is_an_error(data, tmp_path):
    class NoSwitch(nn.Sequential):
        pass

    class Refuses(nn.Sequential):
        def set_grad_checkpointing(self, enable=True):
            if enable:  # as timm's models without it do (an assert)
                raise AssertionError('gradient checkpointing not supported')

    model = NoSwitch(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
    with pytest.raises(ConfigError, match=re.escape('grad_checkpointing=true: my_net (NoSwitch) has no '
                                                    'set_grad_checkpointing()') + '.*drop grad_checkpointing'):
        Trainer(_cfg(data, tmp_path, 'none', model='my_net', grad_checkpointing=True), model=model)
    with pytest.raises(ConfigError, match='my_net does not support it .gradient checkpointing not supported.'):
        Trainer(_cfg(data, tmp_path, 'none', model='my_net', grad_checkpointing=True),
                model=Refuses(nn.Flatten(), nn.Linear(3 * 8 * 8, 10)))


@pytest.mark.slow
def test_compiled_checkpointed_run_matches_to_rounding(data, tmp_path):
    """Under torch.compile the two runs are different graphs, so they agree to float rounding, not bit for bit;
    the BatchNorm statistics too (updated twice per step they would be ~1e-2 off, not ~1e-6)."""
    plain = Trainer(_cfg(data, tmp_path, 'plain', compile=True))
    plain.fit()
    ckpt = Trainer(_cfg(data, tmp_path, 'ckpt', compile=True, grad_checkpointing=True))
    ckpt.fit()
    for (name, a), b in zip(plain.model.state_dict().items(), ckpt.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
