"""Small helpers shared by the layer and deploy tests."""
import torch
from torch import nn


@torch.no_grad()
def randomize_batchnorm_(module: nn.Module, var_range=(0.3, 3.0)) -> nn.Module:
    """Random running statistics and affine parameters for every BatchNorm (default BN is an identity
    and would hide folding bugs, cf. RepVGG's verify script)."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.normal_(0., 1.)
            m.running_var.uniform_(*var_range)
            if m.affine:
                m.weight.normal_(1., 0.5)
                m.bias.normal_(0., 0.5)
    return module


@torch.no_grad()
def perturb_(module: nn.Module, std: float = 0.1, batchnorm: bool = False) -> nn.Module:
    """Move every parameter (norm affines, activation coefficients included) away from its default by
    N(0, std) noise, and optionally the BatchNorm statistics too."""
    for p in module.parameters():
        p.add_(torch.randn_like(p) * std)
    if batchnorm:
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_(0, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return module


def assert_autocast_runs_the_reference_path(layer: nn.Module, x: torch.Tensor) -> None:
    """Under CPU bf16 autocast, ``layer`` without autograd (its inference path, whose ``out=`` matmuls autocast
    does not cast) must give the bf16 output of its reference path (autograd on), exactly."""
    with torch.autocast('cpu', dtype=torch.bfloat16):
        with torch.inference_mode():
            out = layer(x)
        ref = layer(x)  # autograd on: the reference path
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
