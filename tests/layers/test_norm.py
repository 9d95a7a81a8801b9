"""GemmaRMSNorm's fused path (``F.rms_norm``, decode sizes) against its three-step path, bit for bit."""

import pytest
import torch

from pagedllm.layers.norm import FUSED_MAX_ROWS, GemmaRMSNorm


def three_steps(norm: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Gemma3RMSNorm: float32 normalise, multiply by (1 + w), cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return (x32 * (1.0 + norm.weight.float())).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 640), (16, 640), (FUSED_MAX_ROWS, 640), (FUSED_MAX_ROWS + 1, 640),
                                   (3, 4, 256), (7, 1152)])
def test_fused_and_unfused_paths_are_bitwise_equal(dtype, shape):
    torch.manual_seed(shape[0])
    norm = GemmaRMSNorm(shape[-1], eps=1e-6).to(dtype)
    norm.weight.data.normal_(0, 0.5)
    x = (torch.randn(*shape) * 3).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, three_steps(norm, x))


def test_gemma_scale_cache_follows_module_conversions():
    """``GemmaRMSNorm.scale`` returns its cached ``1 + w`` without a per-call device check; the
    cache is recomputed when the module is converted (``_apply``: ``to``, ``to_empty``, ...)."""
    norm = GemmaRMSNorm(8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    assert torch.equal(norm.scale(), 1.0 + norm.weight.float())       # before loading: computed per call
    norm.process_weights_after_loading()
    cached = norm.scale()
    assert cached is norm.scale() and torch.equal(cached, 1.0 + norm.weight.float())
    norm.to(torch.bfloat16)                                            # the weight is rounded: so is 1 + w
    assert norm.scale().dtype == torch.float32
    assert torch.equal(norm.scale(), 1.0 + norm.weight.float())
    norm.to("meta")
    assert norm.scale().device.type == "meta"
