"""Feature entropy (AFBO Table 18): exact values on known distributions, per block on a model."""

import pytest
import timm
import torch

from vitblocks.analysis import block_entropy, feature_entropy


def test_constant_feature_has_zero_entropy_and_uniform_the_maximum():
    const = torch.full((10, 7, 3), 2.5)
    assert feature_entropy(const, bins=16).tolist() == [0.0, 0.0, 0.0]
    uniform = torch.linspace(0, 1, 16 * 50).view(-1, 1).repeat(1, 2)  # 50 values in each of 16 bins
    torch.testing.assert_close(feature_entropy(uniform, bins=16), torch.full((2,), 4.0))  # log2(16) bits
    two_values = torch.tensor([0.0, 1.0] * 20).view(-1, 1)  # half in the first bin, half in the last
    assert feature_entropy(two_values, bins=256).item() == pytest.approx(1.0)
    spread = feature_entropy(torch.rand(200000, 4), bins=256)  # sampled uniform: close to log2(256) = 8
    assert ((spread > 7.99) & (spread <= 8.0)).all()
    with pytest.raises(ValueError, match='bins must be >= 2'):
        feature_entropy(uniform, bins=1)


def test_block_entropy_reads_every_block_without_prefix_tokens():
    torch.manual_seed(0)
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=3, embed_dim=16,
                              num_heads=2).eval()
    x = torch.randn(4, 3, 32, 32)
    report = block_entropy(model, x, name='deit', bins=32)
    assert [b.index for b in report.blocks] == [0, 1, 2] and report.max_entropy == 5.0
    with torch.no_grad():  # by hand: block outputs, class token dropped
        h = model.norm_pre(model._pos_embed(model.patch_embed(x)))
        for b, blk in zip(report.blocks, model.blocks):
            h = blk(h)
            per_channel = feature_entropy(h[:, 1:], 32)
            assert b.mean == pytest.approx(per_channel.mean().item(), rel=1e-6)
            assert b.min == pytest.approx(per_channel.min().item(), rel=1e-6)
            assert b.max == pytest.approx(per_channel.max().item(), rel=1e-6)
            assert 0 < b.min < b.mean < b.max <= 5.0  # 16 channels of different entropy
    assert report.average == pytest.approx(sum(b.mean for b in report.blocks) / 3)
