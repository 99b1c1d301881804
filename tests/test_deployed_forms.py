"""The deploy contract shared by IFFN, AFBO and RePa: ``fuse()`` returns an explicit inference module
(IFFNDeployed, AFBODeployed, RePaDeployedFFN) that can be built directly, loads fused files by name,
compiles to one graph on the CPU, and gives the training form's numbers."""
import pytest
import timm
import torch
from timm.utils import reparameterize_model

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.deploy import reparameterize
from vitblocks.deploy.io import load_deployed, save_deployed
from vitblocks.layers import AFBO, IFFN, AFBODeployed, IFFNDeployed, RePaDeployedFFN, RePaFFN, create_ffn
from vitblocks.layers.registry import FFN_DEPLOYED
from _helpers import perturb_

LAYERS = {
    'iffn': (lambda: IFFN(12, 48, grid_size=(3, 5), num_prefix_tokens=1), IFFNDeployed, torch.randn(2, 16, 12)),
    'afbo': (lambda: AFBO(12, 48, grid_size=(3, 5), num_prefix_tokens=1), AFBODeployed, torch.randn(2, 16, 12)),
    'afbo_channels_first': (lambda: AFBO(12, 48, channels_first=True), AFBODeployed, torch.randn(2, 12, 3, 5)),
    'repa': (lambda: RePaFFN(12, 48), RePaDeployedFFN, torch.randn(2, 16, 12)),
}


def _trained(name):
    build, deployed_cls, x = LAYERS[name]
    return perturb_(build(), std=0.2, batchnorm=True).eval(), deployed_cls, x


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_fuse_returns_the_explicit_inference_module(name):
    layer, deployed_cls, x = _trained(name)
    deployed = layer.fuse()
    assert type(deployed) is deployed_cls and deployed.fuse() is deployed and not deployed.training
    with torch.inference_mode():
        torch.testing.assert_close(deployed(x), layer(x), rtol=1e-5, atol=1e-5)
    assert type(reparameterize_model(torch.nn.Sequential(layer)).get_submodule('0')) is deployed_cls


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_every_deployed_form_compiles_to_one_graph_on_the_cpu(name):
    """torch.compile(fullgraph=True): no graph break in the CPU path (a backend that runs the traced graph as is,
    without inductor's C++ compilation)."""
    layer, _, x = _trained(name)
    deployed = layer.fuse()
    torch._dynamo.reset()
    with torch.inference_mode():
        out = torch.compile(deployed, fullgraph=True, backend='eager')(x)
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


def test_the_training_forms_have_one_forward():
    """No device, grad-mode or autocast switch in the training classes: their forward is the reference, in eval
    mode without autograd too (what the deployed forms are tested against)."""
    for cls in (IFFN, AFBO):
        assert not any(hasattr(cls, name) for name in ('_forward_inference', '_forward_cpu', '_forward_fused'))
    for cls in (IFFNDeployed, AFBODeployed):
        assert hasattr(cls, '_forward_cpu') and hasattr(cls, '_forward_fused')


def test_deploy_true_builds_iffn_deployed_directly():
    assert type(create_ffn('iffn', 12, 48, grid_size=(3, 5), deploy=True)) is IFFNDeployed
    assert type(create_ffn('iffn', 12, 48, grid_size=(3, 5), deploy=False)) is IFFN
    with torch.device('meta'):
        model = timm.create_model('iffn_deit_tiny_patch16_224', block_cfg={'deploy': True})
    assert all(type(m) is IFFNDeployed for m in model.modules() if isinstance(m, IFFN))
    with pytest.raises(TypeError, match="has no argument 'kernel'; did you mean kernel_size"):
        create_ffn('iffn', 12, 48, kernel=3, deploy=True)


def test_deploy_true_builds_afbo_deployed_directly():
    assert type(create_ffn('afbo', 12, 48, grid_size=(3, 5), variant='scfbo_gc', deploy=True)) is AFBODeployed
    assert type(create_ffn('afbo', 12, 48, grid_size=(3, 5), deploy=False)) is AFBO
    with torch.device('meta'):
        model = timm.create_model('afbo_deit_tiny_patch16_224', block_cfg={'deploy': True})
    layers = [m for m in model.modules() if isinstance(m, AFBO)]
    assert len(layers) == 12 and all(type(m) is AFBODeployed for m in layers)


def test_fuse_builds_the_deployed_form_the_registry_holds(monkeypatch):
    """The training forms do not import their deployed forms (which subclass them): fuse() builds the class
    registered for its FFN name, and says what is missing where none is."""
    class Marked(IFFNDeployed):
        pass

    monkeypatch.setitem(FFN_DEPLOYED, 'iffn', Marked)
    assert type(IFFN(12, 48, grid_size=(3, 5)).fuse()) is Marked
    monkeypatch.delitem(FFN_DEPLOYED, 'afbo')
    with pytest.raises(LookupError, match=r"FFN 'afbo' has no registered deployed form \(registered: iffn\)"):
        AFBO(12, 48, grid_size=(3, 5)).fuse()


@pytest.mark.parametrize('name,cls', [('iffn_deit_tiny_patch16_224', IFFNDeployed),
                                      ('afbo_deit_tiny_patch16_224', AFBODeployed)])
def test_deployed_files_load_by_name_into_the_deployed_form(name, cls, tmp_path):
    kwargs = dict(img_size=32, depth=2, num_classes=5)
    model = perturb_(timm.create_model(name, **kwargs), std=0.05, batchnorm=True).eval()
    path = save_deployed(reparameterize(model), tmp_path / 'model.safetensors')
    loaded = load_deployed(name, path, depth=2)  # the file records the sizes (classes, image), not the depth
    layers = [m for m in loaded.modules() if isinstance(m, (IFFN, AFBO))]
    assert len(layers) == 2 and all(type(m) is cls for m in layers)
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
