"""oneDNN packed linear layers (pagedllm/layers/linear.py) against F.linear; merged layers loaded
from their parts' checkpoint names."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.linear import (CPU_GEMM_ENV, MergedLinear, PackedLinear, lm_head_logits,
                                    onednn_linear_available, pack_linear_layers)
from pagedllm.models.utils import load_named_weights
from pagedllm.platforms.cpu import cpu_flags

# bfloat16 runs packed where the CPU multiplies it natively (oneDNN on AVX-512 bf16 / AMX).
NATIVE_BF16 = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
needs_native_bf16 = pytest.mark.skipif(not NATIVE_BF16, reason="the CPU lacks avx512_bf16 and amx_bf16 "
                                       "(bfloat16 is packed only where oneDNN runs it natively)")

# Skip only where this torch build has no oneDNN (mkldnn) at all; where it has it, the probe must
# succeed (test below), so a broken probe fails instead of skipping every oneDNN test.
HAS_ONEDNN = torch.backends.mkldnn.is_available()
needs_onednn = pytest.mark.skipif(not HAS_ONEDNN, reason="this torch build has no oneDNN (mkldnn)")


@needs_onednn
def test_onednn_probe_succeeds_where_onednn_exists():
    assert onednn_linear_available(torch.float32)
    assert onednn_linear_available(torch.bfloat16) is NATIVE_BF16
    assert not onednn_linear_available(torch.float16)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(m, bias):
    torch.manual_seed(m)
    w = torch.randn(96, 40)
    b = torch.randn(96) if bias else None
    layer = PackedLinear(w, b, batch_hint=64)   # a row count other than the hint must work too
    x = torch.randn(m, 40)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_linear_keeps_leading_dims():
    w = torch.randn(8, 5)
    x = torch.randn(2, 3, 5)
    y = PackedLinear(w, None, 4)(x)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_pack_linear_layers_replaces_linears_and_packs_tied_head(monkeypatch, tied_toy):
    monkeypatch.delenv(CPU_GEMM_ENV, raising=False)
    torch.manual_seed(0)
    model = tied_toy()
    x = torch.randn(3, 16)
    want_proj = model.model.proj(x)
    want_logits = F.linear(x, model.model.embed_tokens.weight)
    # cpu_f32_gemm "onednn": oneDNN's layout (tests/layers/test_f32_gemm.py: the default float32 GEMM)
    extra = pack_linear_layers(model, torch.float32, torch.device("cpu"), batch_hint=8, cpu_f32_gemm="onednn")
    assert isinstance(model.model.proj, PackedLinear)
    assert extra == 50 * 16 * 4   # the tied head is the only second copy
    torch.testing.assert_close(model.model.proj(x), want_proj, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm_head_logits(model, x), want_logits, rtol=1e-5, atol=1e-5)


@needs_onednn
@needs_native_bf16
@pytest.mark.parametrize("m", [1, 16, 300])
def test_packed_linear_bf16_matches_f_linear(m):
    """bfloat16 weights and inputs, float32 accumulation: F.linear's result to bfloat16 rounding."""
    torch.manual_seed(m)
    w, b = torch.randn(96, 640).bfloat16(), torch.randn(96).bfloat16()
    x = torch.randn(m, 640).bfloat16()
    y = PackedLinear(w, b, batch_hint=64)(x)
    assert y.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), want, rtol=1.6e-2, atol=0.1)


@needs_onednn
@needs_native_bf16
def test_pack_linear_layers_packs_bf16_and_tied_head(monkeypatch, tied_toy):
    """The LM head gets the same packed kernel as the other layers in bfloat16 too."""
    monkeypatch.delenv(CPU_GEMM_ENV, raising=False)
    torch.manual_seed(0)
    model = tied_toy().to(torch.bfloat16)
    x = torch.randn(3, 16).bfloat16()
    want_logits = F.linear(x.float(), model.model.embed_tokens.weight.float())
    # cpu_bf16_gemm "onednn" keeps oneDNN (layers/bf16_gemm.py; cpu_isa "avx512" now runs the AVX2 GEMM)
    extra = pack_linear_layers(model, torch.bfloat16, torch.device("cpu"), batch_hint=8, cpu_bf16_gemm="onednn")
    assert isinstance(model.model.proj, PackedLinear) and isinstance(model.packed_lm_head, PackedLinear)
    assert extra == 50 * 16 * 2
    torch.testing.assert_close(lm_head_logits(model, x).float(), want_logits, rtol=1.6e-2, atol=2e-2)


def test_pack_linear_layers_is_a_no_op_for_torch_gemm_and_bf16(monkeypatch, tied_toy):
    model = tied_toy()
    monkeypatch.setenv(CPU_GEMM_ENV, "torch")  # read once by EngineArgs, passed on through KernelConfig.cpu_gemm
    assert pack_linear_layers(model, torch.float32, torch.device("cpu"), 8, EngineArgs().cpu_gemm) == 0
    assert isinstance(model.model.proj, nn.Linear) and model.packed_lm_head is None
    monkeypatch.delenv(CPU_GEMM_ENV)
    if not NATIVE_BF16:  # bfloat16 without native instructions forced to "oneDNN" stays on F.linear
        assert pack_linear_layers(model.to(torch.bfloat16), torch.bfloat16, torch.device("cpu"), 8,
                                  cpu_bf16_gemm="onednn") == 0
        assert isinstance(model.model.proj, nn.Linear)


def test_bad_cpu_gemm_name_is_a_value_error(monkeypatch, tied_toy):
    monkeypatch.setenv(CPU_GEMM_ENV, "blas")
    with pytest.raises(ValueError, match=CPU_GEMM_ENV):
        pack_linear_layers(tied_toy(), torch.float32, torch.device("cpu"), 8, EngineArgs().cpu_gemm)
    with pytest.raises(ValueError, match=CPU_GEMM_ENV):
        EngineArgs().create_engine_config(128)


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = MergedLinear(4, [3, 2, 2], ("q_proj", "k_proj", "v_proj"), bias=True)
        self.o_proj = nn.Linear(3, 4, bias=False)


def _attn_checkpoint():
    torch.manual_seed(0)
    return {"attn.q_proj.weight": torch.randn(3, 4), "attn.q_proj.bias": torch.randn(3),
            "attn.k_proj.weight": torch.randn(2, 4), "attn.k_proj.bias": torch.randn(2),
            "attn.v_proj.weight": torch.randn(2, 4), "attn.v_proj.bias": torch.randn(2),
            "attn.o_proj.weight": torch.randn(4, 3)}


def test_merged_linear_loads_its_shards_under_checkpoint_names():
    model = nn.Module()
    model.attn = _Attn()
    ckpt = _attn_checkpoint()
    assert model.attn.qkv_proj.shard_rows() == {"q_proj": (0, 3), "k_proj": (3, 2), "v_proj": (5, 2)}
    loaded = load_named_weights(model, ckpt.items())
    assert loaded == set(ckpt)
    merged = model.attn.qkv_proj
    torch.testing.assert_close(merged.weight[0:3], ckpt["attn.q_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(merged.weight[3:5], ckpt["attn.k_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(merged.weight[5:7], ckpt["attn.v_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(merged.bias[5:7], ckpt["attn.v_proj.bias"], rtol=0, atol=0)
    x = torch.randn(5, 4)
    q, k, v = merged(x).split(merged.output_sizes, dim=-1)
    torch.testing.assert_close(k, F.linear(x, ckpt["attn.k_proj.weight"], ckpt["attn.k_proj.bias"]))


def test_merged_linear_load_errors():
    model = nn.Module()
    model.attn = _Attn()
    ckpt = _attn_checkpoint()
    del ckpt["attn.v_proj.bias"]
    with pytest.raises(ValueError, match="attn.v_proj.bias"):
        load_named_weights(model, ckpt.items())
    ckpt = _attn_checkpoint()
    ckpt["attn.k_proj.weight"] = torch.randn(3, 4)
    with pytest.raises(ValueError, match="shape mismatch for attn.k_proj.weight"):
        load_named_weights(model, ckpt.items())
    with pytest.raises(ValueError, match="qkv_proj"):   # the merged name is not a checkpoint name
        load_named_weights(model, [("attn.qkv_proj.weight", torch.randn(7, 4))])
    with pytest.raises(ValueError, match="output sizes"):
        MergedLinear(4, [3, 2], ("q_proj", "k_proj", "v_proj"))
