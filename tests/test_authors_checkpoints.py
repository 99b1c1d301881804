"""The authors' released checkpoints load through timm and compute the authors' function.

For each layout a state dict is built with the authors' key names and shapes (from their model
definitions: Ackesnal/RePaViT ``repavit.py``, AMD-AIG-AIMA/AMD_IFFN ``vision_transformer.py``),
every tensor random, BatchNorm statistics included; it is saved the way their training scripts
save it (``{'model': ..., 'args': Namespace}``), loaded with ``timm.create_model(...,
checkpoint_path=...)`` and compared with a plain functional evaluation of their forward written
here, before and after ``reparameterize``. Tiny dims (32 px, patch 8, width 16, 2 blocks).
Float64, so a wrong LayerNorm eps (1e-5 vs 1e-6) or head order cannot hide in fp32 tolerance.
"""
import argparse
import datetime
import math
import re

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vitblocks  # noqa: F401  (registers the models)
from vitblocks.cli import main
from vitblocks.deploy import reparameterize
from vitblocks.deploy.io import load_deployed
from vitblocks.models.convert_authors import AuthorsCheckpointError, convert_authors_state_dict

DIM, HEADS, DEPTH, PATCH, IMG, CLASSES = 16, 2, 2, 8, 32, 5
TINY = dict(img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS, num_classes=CLASSES)
TOKENS = (IMG // PATCH) ** 2


def _rand(gen, *shape, scale=0.3):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale


def _batchnorm(gen, prefix, channels):
    return {prefix + 'weight': 1 + _rand(gen, channels), prefix + 'bias': _rand(gen, channels),
            prefix + 'running_mean': _rand(gen, channels),
            prefix + 'running_var': torch.rand(channels, generator=gen, dtype=torch.float64) * 1.5 + 0.5,
            prefix + 'num_batches_tracked': torch.tensor(1000)}


def _layernorm(gen, prefix, channels):
    return {prefix + 'weight': 1 + _rand(gen, channels), prefix + 'bias': _rand(gen, channels)}


def _linear(gen, prefix, c_in, c_out, bias=True):
    sd = {prefix + 'weight': _rand(gen, c_out, c_in, scale=c_in ** -0.5)}
    if bias:
        sd[prefix + 'bias'] = _rand(gen, c_out)
    return sd


def _attention(gen, prefix, dim=DIM):
    return {**_linear(gen, prefix + 'qkv.', dim, 3 * dim), **_linear(gen, prefix + 'proj.', dim, dim)}


# --- RePaViT (repavit.py: timm VisionTransformer with pre_norm=True and their Block/Attention/Mlp) ---

def repavit_state_dict(seed=0, dim=DIM, depth=DEPTH, patch=PATCH, img=IMG, classes=CLASSES):
    """Tiny dims by default; ``dim=192, depth=12, patch=16, img=224, classes=1000`` is RePaViT-Tiny."""
    g = torch.Generator().manual_seed(seed)
    hidden, tokens = 4 * dim, (img // patch) ** 2
    sd = {'cls_token': _rand(g, 1, 1, dim), 'pos_embed': _rand(g, 1, tokens + 1, dim),
          'patch_embed.proj.weight': _rand(g, dim, 3, patch, patch, scale=0.05),  # pre_norm: no bias
          **_layernorm(g, 'norm_pre.', dim), **_layernorm(g, 'norm.', dim), **_linear(g, 'head.', dim, classes)}
    for i in range(depth):
        p = f'blocks.{i}.'
        sd.update({**_layernorm(g, p + 'attn.norm.', dim), **_attention(g, p + 'attn.', dim),
                   **_batchnorm(g, p + 'mlp.norm1.', dim), **_linear(g, p + 'mlp.fc1.', dim, hidden),
                   **_batchnorm(g, p + 'mlp.norm2.', hidden), **_linear(g, p + 'mlp.fc2.', hidden, dim)})
    return sd


def _attend(sd, p, h):
    b, n, c = h.shape
    qkv = F.linear(h, sd[p + 'qkv.weight'], sd[p + 'qkv.bias'])
    q, k, v = qkv.reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)  # (B, N, 3C) -> 3 x (B, h, N, d)
    a = ((q @ k.transpose(-2, -1)) * (c // HEADS) ** -0.5).softmax(-1) @ v
    return F.linear(a.transpose(1, 2).reshape(b, n, c), sd[p + 'proj.weight'], sd[p + 'proj.bias'])  # (B, N, C)


def _bn_tokens(sd, p, x):  # their BatchNorm1d on x.transpose(-1, -2): (B, N, C) -> (B, C, N) -> back
    return F.batch_norm(x.transpose(1, 2), sd[p + 'running_mean'], sd[p + 'running_var'], sd[p + 'weight'],
                        sd[p + 'bias'], False, 0., 1e-5).transpose(1, 2)


def repavit_forward(sd, img, idle_ratio=0.75):
    x = F.conv2d(img, sd['patch_embed.proj.weight'], stride=PATCH).flatten(2).transpose(1, 2)  # (B, N, C)
    x = torch.cat([sd['cls_token'].expand(len(x), -1, -1), x], 1) + sd['pos_embed']
    x = F.layer_norm(x, (DIM,), sd['norm_pre.weight'], sd['norm_pre.bias'], 1e-6)
    for i in range(DEPTH):
        p = f'blocks.{i}.'
        x = x + _attend(sd, p + 'attn.', F.layer_norm(x, (DIM,), sd[p + 'attn.norm.weight'],
                                                      sd[p + 'attn.norm.bias'], 1e-5))  # nn.LayerNorm default eps
        h = F.linear(_bn_tokens(sd, p + 'mlp.norm1.', x), sd[p + 'mlp.fc1.weight'], sd[p + 'mlp.fc1.bias'])
        k = math.ceil(h.shape[-1] * (1 - idle_ratio))
        h = torch.cat([F.gelu(h[..., :k]), h[..., k:]], -1)  # channel idle: GELU on the first k channels
        x = x + F.linear(_bn_tokens(sd, p + 'mlp.norm2.', h), sd[p + 'mlp.fc2.weight'], sd[p + 'mlp.fc2.bias'])
    x = F.layer_norm(x, (DIM,), sd['norm.weight'], sd['norm.bias'], 1e-6)
    return F.linear(x[:, 0], sd['head.weight'], sd['head.bias'])  # class token


# --- IFFN DeiT (AMD_IFFN vision_transformer.py: VisionTransformer, Block, Mlp with MyACT) ---

def iffn_deit_state_dict(kernel_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden, wide = 2 * DIM, 4 * DIM  # their mlp_ratio=2: conv1 D -> 2D, two activations -> 4D
    sd = {'patch_embed.proj.weight': _rand(g, DIM, 3, PATCH, PATCH, scale=0.05), 'patch_embed.proj.bias': _rand(g, DIM),
          'pos_embed': _rand(g, 1, TOKENS, DIM), **_layernorm(g, 'norm.', DIM), **_linear(g, 'head.', DIM, CLASSES)}
    for i in range(DEPTH):
        p = f'blocks.{i}.'
        sd.update({**_layernorm(g, p + 'norm1.', DIM), **_attention(g, p + 'attn.'), **_layernorm(g, p + 'norm2.', DIM),
                   **_linear(g, p + 'mlp.conv1.', DIM, hidden), **_layernorm(g, p + 'mlp.ln1.', wide),
                   f'{p}mlp.conv{kernel_size}x{kernel_size}_dw.weight': _rand(g, wide, 1, kernel_size, kernel_size),
                   f'{p}mlp.conv{kernel_size}x{kernel_size}_dw.bias': _rand(g, wide),
                   **_batchnorm(g, p + 'mlp.ln.', wide), **_linear(g, p + 'mlp.conv2.', wide, DIM),
                   **_layernorm(g, p + 'mlp.ln2.', DIM)})
        for j in (1, 2):
            for move, base in (('move1', 1.), ('move2', 1.)):
                sd[f'{p}mlp.act{j}.{move}.scale'] = base + _rand(g, 1, 1, hidden)
                sd[f'{p}mlp.act{j}.{move}.bias'] = _rand(g, 1, 1, hidden)
    return sd


def iffn_deit_forward(sd, img, kernel_size):
    x = F.conv2d(img, sd['patch_embed.proj.weight'], sd['patch_embed.proj.bias'], stride=PATCH)
    x = x.flatten(2).transpose(1, 2) + sd['pos_embed']  # (B, C, h, w) -> (B, N, C); no class token
    side = IMG // PATCH
    for i in range(DEPTH):
        p = f'blocks.{i}.'
        def ln(t, name, eps):
            return F.layer_norm(t, t.shape[-1:], sd[p + name + '.weight'], sd[p + name + '.bias'], eps)
        x = x + _attend(sd, p + 'attn.', ln(x, 'norm1', 1e-6))
        h = F.linear(ln(x, 'norm2', 1e-6), sd[p + 'mlp.conv1.weight'], sd[p + 'mlp.conv1.bias'])
        acts = [sd[f'{p}mlp.act{j}.move2.scale'] * F.gelu(h * sd[f'{p}mlp.act{j}.move1.scale']
                                                          + sd[f'{p}mlp.act{j}.move1.bias'])
                + sd[f'{p}mlp.act{j}.move2.bias'] for j in (1, 2)]
        h = ln(torch.cat(acts, 2), 'mlp.ln1', 1e-5)
        b, n, c = h.shape
        m = h.reshape(b, side, side, c).permute(0, 3, 1, 2)  # (B, N, 4D) -> (B, 4D, h, w)
        conv = f'{p}mlp.conv{kernel_size}x{kernel_size}_dw.'
        z = F.conv2d(m, sd[conv + 'weight'], sd[conv + 'bias'], padding=kernel_size // 2, groups=c)
        bn = p + 'mlp.ln.'
        z = F.batch_norm(z, sd[bn + 'running_mean'], sd[bn + 'running_var'], sd[bn + 'weight'], sd[bn + 'bias'],
                         False, 0., 1e-5)
        h = (m + F.gelu(z)).permute(0, 2, 3, 1).reshape(b, n, c)  # (B, 4D, h, w) -> (B, N, 4D)
        x = x + ln(F.linear(h, sd[p + 'mlp.conv2.weight'], sd[p + 'mlp.conv2.bias']), 'mlp.ln2', 1e-5)
    x = F.layer_norm(x, (DIM,), sd['norm.weight'], sd['norm.bias'], 1e-6).mean(1)  # norm every token, then average
    return F.linear(x, sd['head.weight'], sd['head.bias'])


def _save_like_the_authors(tmp_path, sd, name='checkpoint.pth'):
    path = tmp_path / name
    torch.save({'model': {k: v.float() for k, v in sd.items()}, 'epoch': 299, 'args': argparse.Namespace(lr=1e-3)},
               path)
    return path


def _image(seed=1):
    return torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _assert_authors_function(model, reference, img):
    model = model.double().eval()
    with torch.no_grad():
        expected = reference(img)
        assert torch.allclose(model(img), expected, rtol=0, atol=1e-9), (model(img) - expected).abs().max()
        deployed = reparameterize(model)
        assert torch.allclose(deployed(img), expected, rtol=0, atol=1e-9), (deployed(img) - expected).abs().max()
    return deployed


@pytest.mark.parametrize('name', ['repa_prenorm_deit_tiny_patch16_224', 'repa_prenorm_vit_huge_patch16_224'])
def test_repavit_checkpoint_loads_through_timm_and_matches_their_forward(tmp_path, name):
    sd = repavit_state_dict()
    path = _save_like_the_authors(tmp_path, sd)
    model = timm.create_model(name, checkpoint_path=str(path), **TINY)
    sd = {k: v.float().double() for k, v in sd.items()}  # the values the file holds
    deployed = _assert_authors_function(model, lambda x: repavit_forward(sd, x), _image())
    assert type(deployed.blocks[0].mlp).__name__ == 'RePaDeployedFFN'


@pytest.mark.parametrize('name, kernel_size', [('iffn_deit_tiny_patch16_224', 3), ('iffn_deit_base_patch16_224', 5)])
def test_iffn_deit_checkpoint_loads_through_timm_and_matches_their_forward(tmp_path, name, kernel_size):
    sd = iffn_deit_state_dict(kernel_size)
    path = _save_like_the_authors(tmp_path, sd)
    model = timm.create_model(name, checkpoint_path=str(path), **TINY)
    sd = {k: v.float().double() for k, v in sd.items()}
    deployed = _assert_authors_function(model, lambda x: iffn_deit_forward(sd, x, kernel_size), _image())
    assert deployed.blocks[0].mlp.deploy


def test_iffn_deit_head_normalizes_every_token_then_averages():
    """The authors' head is mean(LayerNorm(tokens)), not timm's LayerNorm(mean(tokens));
    same parameters (the LayerNorm only moves from ``fc_norm`` to ``norm``)."""
    model = timm.create_model('iffn_deit_tiny_patch16_224', **TINY).eval()
    x = torch.randn(2, 3, IMG, IMG)
    with torch.no_grad():
        tokens = model.blocks(model.patch_embed(x) + model.pos_embed)  # (B, N, C), no class token
        norm = model.norm
        expected = model.head(F.layer_norm(tokens, (DIM,), norm.weight, norm.bias, norm.eps).mean(1))
        assert torch.allclose(model(x), expected, rtol=0, atol=1e-6)
    assert isinstance(model.fc_norm, torch.nn.Identity) and norm.eps == 1e-6
    timm_head = timm.create_model('iffn_deit_tiny_patch16_224', fc_norm=None, **TINY)  # timm's avg-then-norm
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in timm_head.parameters())
    full_size = timm.create_model('iffn_deit_tiny_patch16_224', device='meta')
    assert sum(p.numel() for p in full_size.parameters()) == 4_998_184  # authors' README: 5.00 M


def test_our_own_layout_still_loads_and_other_models_pass_through():
    model = timm.create_model('repa_prenorm_deit_tiny_patch16_224', **TINY)
    other = timm.create_model('repa_prenorm_deit_tiny_patch16_224', **TINY)
    other.load_state_dict(model.state_dict())  # the hook leaves our layout alone
    for k, v in model.state_dict().items():
        assert torch.equal(other.state_dict()[k], v), k


def test_repavit_file_into_a_model_without_pre_norm_says_which_to_build(tmp_path):
    path = _save_like_the_authors(tmp_path, repavit_state_dict())
    with pytest.raises(AuthorsCheckpointError, match='build repa_prenorm_deit_small_patch16_224'):
        timm.create_model('repa_deit_small_patch16_224', checkpoint_path=str(path), **TINY)


def test_a_model_that_differs_from_theirs_in_a_norm_is_refused(tmp_path):
    """pre_norm=True alone is not their RePaViT (attention LayerNorm eps), nor timm's LayerNorm their IFFN."""
    path = _save_like_the_authors(tmp_path, repavit_state_dict())
    with pytest.raises(AuthorsCheckpointError, match='eps-1e-5 LayerNorms before attention'):
        timm.create_model('repa_deit_tiny_patch16_224', checkpoint_path=str(path), pre_norm=True, **TINY)
    path = _save_like_the_authors(tmp_path, iffn_deit_state_dict(3))
    with pytest.raises(AuthorsCheckpointError, match='eps-1e-5 LayerNorms in the IFFN'):
        timm.create_model('iffn_deit_tiny_patch16_224', checkpoint_path=str(path),
                          block_cfg=dict(norm_layer=timm.layers.LayerNorm), **TINY)


def test_authors_file_into_the_deploy_form_is_refused_with_the_fix(tmp_path):
    path = _save_like_the_authors(tmp_path, repavit_state_dict())
    with pytest.raises(AuthorsCheckpointError, match='deploy form.*reparameterize'):
        timm.create_model('repa_prenorm_deit_tiny_patch16_224', checkpoint_path=str(path),
                          block_cfg=dict(deploy=True), **TINY)
    path = _save_like_the_authors(tmp_path, iffn_deit_state_dict(3))
    with pytest.raises(AuthorsCheckpointError, match='deploy form'):
        timm.create_model('iffn_deit_tiny_patch16_224', checkpoint_path=str(path), block_cfg=dict(deploy=True), **TINY)


def test_layernorm_feature_norm_checkpoint_is_not_repa():
    sd = repavit_state_dict()
    for i in range(DEPTH):  # their --feature_norm=LayerNorm: one mlp.norm, no BatchNorms
        for kind in ('weight', 'bias'):
            sd[f'blocks.{i}.mlp.norm.{kind}'] = sd.pop(f'blocks.{i}.mlp.norm1.{kind}')
    with pytest.raises(AuthorsCheckpointError, match='feature_norm=LayerNorm'):
        convert_authors_state_dict(sd)


@pytest.mark.parametrize('layout, theirs, ours', [
    ('repavit', 'blocks.0.attn.norm.weight', 'blocks.0.norm1.weight'),
    ('iffn_deit', 'blocks.1.mlp.conv1.weight', 'blocks.1.mlp.fc1.weight'),
    ('iffn_deit', 'blocks.0.mlp.act1.move2.bias', 'blocks.0.mlp.act.theta'),  # a stacked AGeLU parameter
])
def test_a_tensor_under_both_names_is_an_error_naming_both(tmp_path, layout, theirs, ours):
    """A dict holding an authors' key and our name for it (a half-converted file) kept whichever came last."""
    sd = repavit_state_dict() if layout == 'repavit' else iffn_deit_state_dict(3)
    sd[ours] = torch.zeros(2, sd[theirs].numel()) if ours.endswith('theta') else torch.zeros_like(sd[theirs])
    with pytest.raises(AuthorsCheckpointError, match=f"both '{re.escape(theirs)}' and '{re.escape(ours)}'"):
        convert_authors_state_dict(sd)
    path = _save_like_the_authors(tmp_path, sd)  # timm's loading path passes the same check
    with pytest.raises(AuthorsCheckpointError, match='mixes the authors'):
        timm.create_model('repa_prenorm_deit_tiny_patch16_224' if layout == 'repavit' else 'iffn_deit_tiny_patch16_224',
                          checkpoint_path=str(path), **TINY)


def test_wrong_size_fails_on_the_tensor_that_differs(tmp_path):
    path = _save_like_the_authors(tmp_path, repavit_state_dict())
    with pytest.raises(RuntimeError, match='size mismatch for blocks.0.norm1.weight'):
        timm.create_model('repa_prenorm_deit_tiny_patch16_224', checkpoint_path=str(path), **{**TINY, 'embed_dim': 32})


def test_a_file_of_the_other_paper_names_the_models_that_take_it(tmp_path):
    path = _save_like_the_authors(tmp_path, repavit_state_dict())
    with pytest.raises(AuthorsCheckpointError, match='load it into one of repa_prenorm_'):
        timm.create_model('iffn_deit_tiny_patch16_224', checkpoint_path=str(path), **TINY)


# --- vitblocks convert --------------------------------------------------------------------------

_TINY_ARGS = ['--model-args'] + [f'{k}={v}' for k, v in TINY.items()]


def _convert(capsys, *argv):
    code = main(['convert', *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_convert_writes_our_layout_in_both_forms(tmp_path, capsys):
    sd = repavit_state_dict()
    src = _save_like_the_authors(tmp_path, sd)
    sd = {k: v.float() for k, v in sd.items()}
    name = 'repa_prenorm_deit_tiny_patch16_224'
    code, out, _ = _convert(capsys, src, tmp_path / 'train.safetensors', '--model', name, *_TINY_ARGS)
    assert code == 0 and f"the authors' repavit layout, {len(sd)} tensors -> {name}" in out, out
    img = _image().float()
    with torch.no_grad():
        expected = repavit_forward(sd, img)
        trained = timm.create_model(name, checkpoint_path=str(tmp_path / 'train.safetensors'), **TINY).eval()
        assert torch.allclose(trained(img), expected, rtol=0, atol=1e-5)
        code, out, _ = _convert(capsys, src, tmp_path / 'deployed.safetensors', '--model', name, '--deploy',
                                *_TINY_ARGS)
        assert code == 0 and 'deployed (re-parameterized)' in out
        deployed = load_deployed(name, tmp_path / 'deployed.safetensors', **TINY)
        assert type(deployed.blocks[0].mlp).__name__ == 'RePaDeployedFFN'
        assert torch.allclose(deployed(img), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize('case, message', [
    ('missing', 'no checkpoint at .*missing.pth: the file does not exist'),
    ('truncated', 'cannot read .* as a torch checkpoint'),
    ('text', r"is not a torch checkpoint \(torch.save writes a zip archive.*starts with b'hello, n'\)"),
    ('empty', 'is empty, not a torch checkpoint'),
    ('safetensors', 'is a safetensors file, not a torch checkpoint'),
    ('object', r'holds pickled objects other than tensors \(datetime.date\); if you trust it'),
    ('ours', "in no authors' layout"),
    ('dst', 'DST must end with .safetensors'),
    ('ema', "has no 'model_ema' entry .*drop --ema"),
    ('swin', "cannot hold; use one of repa_prenorm_"),
    ('size', 'the checkpoint has width 16, 2 blocks, 5 classes, the model width 16, 2 blocks, 7 classes'),
])
def test_convert_errors_say_what_and_how_to_fix(tmp_path, capsys, case, message):
    src = _save_like_the_authors(tmp_path, repavit_state_dict())
    dst, args = tmp_path / 'out.safetensors', ['--model', 'repa_prenorm_deit_tiny_patch16_224', *_TINY_ARGS]
    if case == 'missing':
        src = tmp_path / 'missing.pth'
    elif case == 'truncated':
        src.write_bytes(src.read_bytes()[:1000])
    elif case == 'text':  # torch's weights-only unpickler raised a bare KeyError on this one
        src.write_text('hello, not a checkpoint\n')
    elif case == 'empty':
        src.write_bytes(b'')
    elif case == 'safetensors':  # named .pth (torch.load reads a file named .safetensors as one)
        save_file(timm.create_model('repa_prenorm_deit_tiny_patch16_224', **TINY).state_dict(), src)
    elif case == 'object':
        torch.save({'model': {}, 'date': datetime.date(2025, 1, 1)}, src)
    elif case == 'ours':
        torch.save({'model': timm.create_model('repa_prenorm_deit_tiny_patch16_224', **TINY).state_dict()}, src)
    elif case == 'dst':
        dst = tmp_path / 'out.pth'
    elif case == 'ema':
        args.append('--ema')
    elif case == 'swin':
        args = ['--model', 'repa_swin_tiny_patch4_window7_224']
    elif case == 'size':
        args = args + ['num_classes=7']
    code, _, err = _convert(capsys, src, dst, *args)
    assert code == 2 and re.search(message, err), err
    assert len(err.strip().splitlines()) == 1 and not dst.exists()


@pytest.mark.parametrize('case, message', [
    ('folder', r'DST .*out.safetensors: is a folder; give a file name'),
    ('under a file', r'DST .*blocker/out.safetensors: .*blocker is a file, not a folder'),
    ('model args', r"--model-args expects KEY=VALUE, got 'num_classes' \(e.g. --model-args num_classes=100\)"),
])
def test_convert_refuses_an_unwritable_dst_and_names_the_flag_it_parsed(tmp_path, capsys, case, message):
    # an unwritable DST was a traceback from the atomic write (IsADirectoryError, FileExistsError) after the
    # whole conversion; a malformed --model-args item was reported as a --block-cfg one
    src = _save_like_the_authors(tmp_path, repavit_state_dict())
    dst, args = tmp_path / 'out.safetensors', ['--model', 'repa_prenorm_deit_tiny_patch16_224', *_TINY_ARGS]
    if case == 'folder':
        dst.mkdir()
    elif case == 'under a file':
        (tmp_path / 'blocker').write_text('x')
        dst = tmp_path / 'blocker' / 'out.safetensors'
    else:
        args.append('num_classes')
    code, _, err = _convert(capsys, src, dst, *args)
    assert code == 2 and re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
    assert not list(tmp_path.glob('.*')), 'a temporary of the write was left behind'
    assert dst.is_dir() if case == 'folder' else not dst.exists()


def test_a_source_that_cannot_be_opened_is_one_line(tmp_path):
    """torch.load's own OSError (permissions, a file gone meanwhile) is reported, not a second one from
    reading the file's first bytes."""
    from vitblocks.cli.convert import _unreadable
    gone = tmp_path / 'gone.pth'
    error = PermissionError(13, 'Permission denied', str(gone))
    message = _unreadable(gone, error)
    assert message == f"cannot read {gone} as a torch checkpoint ([Errno 13] Permission denied: '{gone}')"
