"""int8 linear layers (pagedllm/layers/quantization.py): weight quantization by hand, the output
against F.linear within the bound int8 rounding allows, and the engine option's validation."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import ModelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.linear import lm_head_logits
from pagedllm.layers.quantization import (WEIGHT_QMAX, Int8DynamicLinear, int8_linear_available,
                                          quantize_linear_layers, quantize_weight_per_channel)

# Skip only where torch has no fbgemm engine at all (non-x86 builds); where it has one, the probe
# must succeed (test below), so a broken probe fails instead of skipping everything.
HAS_FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines
needs_int8 = pytest.mark.skipif(not HAS_FBGEMM, reason="this torch build has no fbgemm engine")


@needs_int8
def test_int8_probe_succeeds_where_fbgemm_exists():
    assert int8_linear_available()


def test_quantize_weight_per_channel_by_hand():
    w = torch.tensor([[0.5, -1.27, 0.0, 0.004],
                      [0.0, 0.0, 0.0, 0.0],
                      [2.54, 1.0, -2.54, 0.01]])
    wq, scale = quantize_weight_per_channel(w, qmax=127)
    torch.testing.assert_close(scale, torch.tensor([0.01, 1.0, 0.02]))   # max|row| / 127; zero row -> 1
    assert wq.dtype == torch.int8
    assert wq.tolist() == [[50, -127, 0, 0], [0, 0, 0, 0], [127, 50, -127, 0]]   # round(w / scale)
    wq, scale = quantize_weight_per_channel(torch.tensor([[0.63, -0.25, 0.004]]))   # the default: 7-bit range
    assert WEIGHT_QMAX == 63
    torch.testing.assert_close(scale, torch.tensor([0.01]))
    assert wq.tolist() == [[63, -25, 0]]


def _int8_error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Largest |y - x W^T| int8 rounding allows per output element [M, N]: weight steps of
    scale[o] (error <= scale/2 each) and activation steps of at most 2 * max|x_row| / 255 (uint8
    over the row's [min, max], error <= step/2 each), plus their product."""
    _, scale = quantize_weight_per_channel(w)
    x_step = 2 * x.abs().amax(dim=1, keepdim=True) / 255            # [M, 1]
    w_err = scale[None, :] / 2                                       # [1, N]
    return (x.abs().sum(1, keepdim=True) * w_err                     # weight rounding
            + x_step / 2 * w.abs().sum(1)[None, :]                   # activation rounding
            + x_step / 2 * w_err * w.shape[1]) * 1.01 + 1e-6        # both


@needs_int8
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_int8_linear_within_rounding_bound_of_f_linear(m, bias):
    torch.manual_seed(m)
    w = torch.randn(48, 96) * 0.05
    b = torch.randn(48) if bias else None
    x = torch.randn(m, 96) * torch.logspace(-2, 1, m)[:, None]   # rows of very different sizes
    x[0, 3] = 30.0                                                # one outlier
    y = Int8DynamicLinear(w, b)(x)
    want = F.linear(x, w, b)
    err = (y - want).abs()
    assert bool((err <= _int8_error_bound(x, w)).all()), float((err / _int8_error_bound(x, w)).max())
    assert float(err.max()) > 0   # it is really quantized, not a float32 path


@needs_int8
def test_int8_does_not_saturate_where_full_range_weights_would():
    """Rows of +1 (one -1 to give them a range): their activations quantize to uint8 255 and every
    uint8 x int8 pair sum is at its largest. With 8-bit weights AVX2's int16 pair sums saturate
    (fbgemm then returns about 0.5 instead of 62); with the 7-bit weights they do not."""
    w = torch.ones(8, 64)
    x = torch.ones(2, 64)
    x[:, -1] = -1.0
    torch.testing.assert_close(Int8DynamicLinear(w, None)(x), torch.full((2, 8), 62.0), rtol=1e-2, atol=0)
    torch.testing.assert_close(Int8DynamicLinear(-w, None)(x), torch.full((2, 8), -62.0), rtol=1e-2, atol=0)


@needs_int8
def test_int8_result_of_a_row_does_not_depend_on_the_batch():
    """Each row is mapped onto [-1, 1] by its own range, so fbgemm's per-call range is the same for
    any batch: a row alone and the same row among others give bitwise the same output."""
    torch.manual_seed(3)
    layer = Int8DynamicLinear(torch.randn(40, 96) * 0.05, torch.randn(40))
    x = torch.randn(9, 96) * torch.logspace(-3, 2, 9)[:, None] + torch.randn(9, 1)
    x[4] = 0.7                                   # a constant row too
    batched = layer(x)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone)
    assert torch.equal(layer(x[2:5]), batched[2:5])


@needs_int8
def test_int8_rows_are_scaled_per_token():
    """A small row next to a huge one keeps its own precision (per-token scaling): its error stays
    within its own bound, which is 1000x tighter than the batch's."""
    torch.manual_seed(0)
    w = torch.randn(32, 64) * 0.1
    small = torch.randn(1, 64) * 1e-3
    big = torch.randn(1, 64) * 1e3
    y = Int8DynamicLinear(w, None)(torch.cat([small, big]))
    err_small = (y[0] - F.linear(small, w)[0]).abs()
    assert bool((err_small <= _int8_error_bound(small, w)[0]).all())


@needs_int8
def test_quantize_linear_layers_replaces_linears_and_the_tied_head(tied_toy):
    torch.manual_seed(0)
    model = tied_toy(24)
    x = torch.randn(3, 16)
    w_proj, b_proj = model.model.proj.weight.detach().clone(), model.model.proj.bias.detach().clone()
    w_head = model.model.embed_tokens.weight.detach().clone()
    delta = quantize_linear_layers(model)
    assert isinstance(model.model.proj, Int8DynamicLinear)
    assert isinstance(model.packed_lm_head, Int8DynamicLinear)
    # proj: 24*16 float32 + 24 bias (4 B) -> 24*(16+2) int8 (two range-pin columns) + 24 scales + 24 bias;
    # head: 50*(16+2) int8 + 50 scales.
    assert delta == (24 * 18 + 2 * 24 * 4) - (24 * 16 * 4 + 24 * 4) + (50 * 18 + 50 * 4)
    proj_err = (model.model.proj(x) - F.linear(x, w_proj, b_proj)).abs()
    assert bool((proj_err <= _int8_error_bound(x, w_proj)).all())
    head_err = (lm_head_logits(model, x) - F.linear(x, w_head)).abs()
    assert bool((head_err <= _int8_error_bound(x, w_head)).all())


def test_quantize_linear_layers_needs_float32_on_cpu(tied_toy):
    with pytest.raises(ValueError, match="float32"):
        quantize_linear_layers(tied_toy(24).to(torch.bfloat16))


def test_quantization_values_are_validated():
    with pytest.raises(ValueError, match="quantization"):
        ModelConfig(quantization="int4")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(quantization="int8", dtype="bfloat16")
    with pytest.raises(ValueError, match="CPU"):
        ModelConfig(quantization="int8", device="cuda")
    model_cfg = EngineArgs(quantization="int8").create_engine_config(2048).model_config
    assert model_cfg.quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="awq").create_engine_config(2048)
