"""count_macs on tiny hand-countable models: the norm conventions, GFLOPs = 2 x GMACs, per-module sums."""
import pytest
import torch
from torch import nn

from vitblocks.profile import count_macs


def _tiny():
    # (1, 3, 4) -> Linear(4, 6): 3*4*6 = 72 MACs -> LayerNorm(6) without affine over 18 elements
    # -> Linear(6, 2): 3*6*2 = 36 MACs -> BatchNorm1d(3) without affine over 6 elements
    return nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6, elementwise_affine=False)),
                         nn.Linear(6, 2), nn.BatchNorm1d(3, affine=False))


def test_norms_cost_one_mac_per_element_without_affine_two_with_it():
    """ptflops: a norm costs 1 MAC per output element, 2 with an affine scale and shift."""
    x = torch.randn(1, 3, 4)
    assert count_macs(_tiny(), inputs=x).total == 72 + 36
    plain = count_macs(_tiny(), inputs=x, include_norms=True)
    assert plain.total == 72 + 36 + 18 + 6
    assert plain.by_op == {'addmm': 108, 'native_layer_norm': 18, '_native_batch_norm_legit_no_training': 6}
    affine = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    assert count_macs(affine, inputs=x, include_norms=True).total == 72 + 2 * 18
    flat = count_macs(_tiny(), inputs=x, include_norms=True, norm_macs_per_element=5)  # fvcore: 5, affine or not
    assert flat.total == 72 + 36 + 5 * (18 + 6)


def test_gflops_are_twice_the_gmacs_and_modules_sum_per_depth():
    report = count_macs(_tiny(), inputs=torch.randn(1, 3, 4), include_norms=True)
    assert report.gmacs == pytest.approx(132 / 1e9) and report.gflops == pytest.approx(2 * 132 / 1e9)
    assert report.top_modules(1) == {'Sequential.0': 90, 'Sequential.1': 36, 'Sequential.2': 6}
    assert report.top_modules(2) == {'Sequential.0.0': 72, 'Sequential.0.1': 18}
    assert sum(report.top_modules(1).values()) == report.total


def test_counting_runs_in_eval_mode_and_restores_training_mode():
    """Dropout and BatchNorm batch statistics must not change the count, and the caller's mode comes back."""
    model = _tiny().train()
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(m.training))
    count_macs(model, inputs=torch.randn(1, 3, 4))
    assert seen == [False] and all(m.training for m in model.modules())
