"""Checks shared by the CycleMLP and Hire-MLP tests: the timm conformance checks on a small input and,
through ``**kwargs``, a one-block-per-stage model (the code paths of the full models; the 224 px runs
over the registered models are `slow`, in test_registry_models.py and test_conformance.py), and the
swap counts."""
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vitblocks

SMALL = (2, 3, 64, 96)  # a non-square input, stage maps 16x24 ... 2x3


def agrees(ours: float, published: float, decimals: int) -> bool:
    """Within 1% of a published number, or equal to it at the precision it was printed with."""
    return abs(ours / published - 1) <= 0.01 or abs(ours - published) <= 0.5 * 10 ** -decimals


def forward_backward_every_parameter(name: str, **kwargs) -> None:
    model = timm.create_model(name, num_classes=10, **kwargs).train()
    out = model(torch.randn(*SMALL))
    assert out.shape == (2, 10)
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), f'{name}: {pname}'


def fx_and_torchscript_match_eager(name: str, **kwargs) -> None:
    model = timm.create_model(name, num_classes=7, **kwargs).eval()
    x = torch.randn(*SMALL)
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    nodes = get_graph_node_names(model, tracer_kwargs=kw)[1]
    traced = create_feature_extractor(model, return_nodes=[nodes[-1]], tracer_kwargs=kw)
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(next(iter(traced(x).values())), ref)
        torch.testing.assert_close(torch.jit.script(model)(x), ref)


def features_only_maps(name: str, channels, **kwargs) -> None:
    """features_only / forward_intermediates: four NCHW stage maps at strides 4..32, on a non-square input."""
    feats = timm.create_model(name, features_only=True, **kwargs).eval()
    assert feats.feature_info.channels() == list(channels)
    assert feats.feature_info.reduction() == [4, 8, 16, 32]
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        outs = feats(x)
    assert [tuple(o.shape[1:]) for o in outs] == [(c, 64 // r, 96 // r) for c, r in zip(channels, (4, 8, 16, 32))]
    picked = timm.create_model(name, features_only=True, out_indices=(1, 3), **kwargs)
    assert picked.feature_info.channels() == [channels[1], channels[3]]


def swap_counts(name: str, n_blocks: int, channels_first: bool, **kwargs) -> None:
    """swap_ffn reaches every block's channel MLP (and only those) in the backbone's layout."""
    model = timm.create_model(name, num_classes=3, **kwargs)
    assert vitblocks.swap_ffn(model, 'iffn') == n_blocks
    iffns = [m for m in model.modules() if isinstance(m, vitblocks.layers.IFFN)]
    assert len(iffns) == n_blocks and all(m.layout.channels_first == channels_first for m in iffns)
    assert model(torch.randn(*SMALL)).shape == (2, 3)
