"""Grad-CAM (AFBO Figs. 3-4): target layer and reshape per timm family, and maps that find an object."""
import pytest
import timm
import torch

pytest.importorskip('pytorch_grad_cam')
from vitblocks.analysis import gradcam_maps, gradcam_target  # noqa: E402


@pytest.mark.parametrize('name, kwargs, size', [
    ('deit_tiny_patch16_224', dict(img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2), 32),  # class token
    ('vit_tiny_patch16_224', dict(img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2, reg_tokens=2), 32),
    ('swin_tiny_patch4_window7_224',
     dict(img_size=32, window_size=2, embed_dim=8, depths=(1, 1), num_heads=(1, 1)), 32),
    ('poolformer', dict(depths=(1, 1, 1, 1), dims=(8, 8, 8, 8)), 64),  # channels-first
    ('mixer', dict(img_size=32, patch_size=8, num_blocks=1, embed_dim=16), 32),
])
def test_maps_have_the_input_size_for_every_family(name, kwargs, size):
    torch.manual_seed(0)
    if name == 'poolformer':  # timm's poolformer_s12 recipe, shrunk (its entry point fixes depths and dims)
        from timm.models.metaformer import GroupNorm1, MetaFormer, Pooling
        model = MetaFormer(num_classes=3, token_mixers=Pooling, norm_layers=GroupNorm1, use_mlp_head=False, **kwargs)
    elif name == 'mixer':  # mixer_s16_224 fixes patch_size; build the class
        model = timm.models.mlp_mixer.MlpMixer(num_classes=3, **kwargs)
    else:
        model = timm.create_model(name, num_classes=3, **kwargs)
    x = torch.randn(2, 3, size, size)
    maps = gradcam_maps(model, x, targets=[0, 2])
    assert maps.shape == (2, size, size)
    assert maps.min() >= 0 and maps.max() <= 1 + 1e-6
    layer, reshape = gradcam_target(model)
    feats = {}
    h = layer.register_forward_hook(lambda m, a, o: feats.setdefault('o', o))
    model(x)
    h.remove()
    fmap = reshape(feats['o']) if reshape else feats['o']
    assert fmap.ndim == 4 and fmap.shape[0] == 2  # (B, C, H, W) for grad-cam


def test_reshape_rejects_a_token_count_that_is_not_the_grid():
    model = timm.create_model('deit_tiny_patch16_224', img_size=32, patch_size=8, depth=1, embed_dim=16, num_heads=2)
    _, reshape = gradcam_target(model)
    with pytest.raises(ValueError, match='do not match 1 prefix tokens \\+ a 4x4 grid'):
        reshape(torch.randn(1, 10, 16))


def _square_images(n, g):
    """16x16 images, dark noise; label 1: a bright 4x4 square on a random cell of the 4x4 patch grid."""
    x = 0.1 * torch.rand(n, 3, 16, 16, generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)
    cells = torch.randint(0, 4, (n, 2), generator=g)
    for i in range(n):
        if labels[i]:
            r, c = 4 * cells[i].tolist()[0], 4 * cells[i].tolist()[1]
            x[i, :, r:r + 4, c:c + 4] = 1.0
    return x, labels, cells


def test_maps_highlight_the_object_a_trained_model_finds():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = timm.create_model('vit_tiny_patch16_224', img_size=16, patch_size=4, depth=1, embed_dim=16,
                              num_heads=2, num_classes=2, class_token=False, global_pool='avg')
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(80):  # seconds: learns "is there a square"
        x, y, _ = _square_images(32, g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y, cells = _square_images(64, g)
    with torch.no_grad():
        assert (model(x).argmax(-1) == y).float().mean() > 0.95
    x, cells = x[y == 1][:12], cells[y == 1][:12]
    maps = gradcam_maps(model, x, targets=[1] * len(x))
    assert maps.shape == (len(x), 16, 16)
    cell_means = torch.as_tensor(maps).view(-1, 4, 4, 4, 4).mean((2, 4))  # (B, 16, 16) -> (B, 4 cells, 4 cells)
    top2 = [[divmod(int(i), 4) for i in m.flatten().topk(2).indices] for m in cell_means]
    hits = sum(tuple(c) in best for best, c in zip(top2, cells.tolist()))
    # global attention spreads the evidence, so ask for the square among the two hottest of 16 cells
    assert hits >= 2 / 3 * len(x)  # chance: 1 in 8 per image; a transposed or shifted reshape fails this
    contrast = [m[r, c] / m.mean() for m, (r, c) in zip(cell_means, cells.tolist())]
    assert sorted(contrast)[len(contrast) // 2] > 3  # and well above the rest of the image (median)
