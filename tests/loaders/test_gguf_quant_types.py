"""Every GGUF tensor type the loader lists (``SUPPORTED_GGUF_TYPES``) against the ``gguf`` library.

For each type, GGUF files are written here with ``gguf.GGUFWriter``: real float data quantized by
gguf-py where it has a numpy quantizer (F32/F16/BF16, Q4_0 ... Q8_0), else valid random blocks
(K-quants, IQ4_XS: :func:`pagedllm.benchmarks.gguf_types.random_blocks`). Our dequantized tensors
must equal ``gguf.quants.dequantize`` of the bytes ``gguf.GGUFReader`` finds, bit for bit; a tiny
Llama stored in each block type must convert to the weights transformers loads from the same GGUF,
and the engine's float32 greedy output and logprobs must equal transformers' run of that model.
Other types are a ValueError naming the tensor and the type.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_gguf_tiny import write_tiny_gguf

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.gguf_types import encode, random_blocks
from pagedllm.loaders import gguf as gguf_loader
from pagedllm.loaders import iterate_weights, resolve_model
from pagedllm.loaders.gguf import SUPPORTED_GGUF_TYPES, dequantize_tensor, read_gguf_header
from pagedllm.tokenizer import Tokenizer

BLOCK_TYPES = [t for t in SUPPORTED_GGUF_TYPES if t not in ("F32", "F16", "BF16")]
# A tiny Llama whose every row length (256 hidden, 512 intermediate) is a multiple of the
# K-quants' 256-value super-block.
KQUANT_LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.05)
SHAPES = {"a.weight": (5, 512), "b.weight": (3, 256), "c.weight": (256,)}


def test_the_listed_types():
    assert set(SUPPORTED_GGUF_TYPES) == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "IQ4_XS"}


def _write(path: str, tensors: dict[str, tuple[np.ndarray, int | None]]) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("type_name", SUPPORTED_GGUF_TYPES)
@pytest.mark.parametrize("chunk_values", [512, 1 << 24])
def test_dequantized_tensors_equal_gguf(type_name, chunk_values, tmp_path, monkeypatch):
    """Bit for bit, one row per chunk (512 values) and the whole tensor at once."""
    monkeypatch.setattr(gguf_loader, "_DEQUANT_CHUNK_VALUES", chunk_values)
    rng = np.random.default_rng(7)
    originals = {name: rng.normal(0.0, 0.05, shape).astype(np.float32) for name, shape in SHAPES.items()}
    path = str(tmp_path / f"{type_name}.gguf")
    _write(path, {name: encode(type_name, data, rng) for name, data in originals.items()})

    header = read_gguf_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    ours = {info.name: dequantize_tensor(blob, info) for info in header.tensors}
    assert [Q(info.ggml_type).name for info in header.tensors] == [type_name] * len(SHAPES)
    for tensor in gguf.GGUFReader(path).tensors:
        reference = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        got = ours[tensor.name]
        assert got.dtype == np.float32 and got.shape == SHAPES[tensor.name]
        assert np.array_equal(got.reshape(-1).view(np.uint32), reference.reshape(-1).view(np.uint32)), tensor.name
        assert np.isfinite(got).all() and got.std() > 0.005, tensor.name

    for name, original in originals.items():  # and the values are the data's (or near it)
        if type_name == "F32":
            assert np.array_equal(ours[name], original)
        elif type_name == "F16":
            assert np.array_equal(ours[name], original.astype(np.float16).astype(np.float32))
        elif type_name == "BF16":
            expected = torch.from_numpy(original).bfloat16().float().numpy()
            assert np.array_equal(ours[name], expected)
        elif type_name.endswith("_0") or type_name.endswith("_1"):
            # gguf-py quantized the data: 4-bit blocks err by at most ~1/8 of the block's peak
            assert np.abs(ours[name] - original).max() < 0.04, name
        else:
            assert np.abs(ours[name]).max() <= 0.1 + 1e-3, name  # random blocks, |value| <= max_abs


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_random_blocks_equal_gguf(type_name):
    """random_blocks covers bit patterns a quantizer never writes; IQ4_XS runs our own decoder."""
    rng = np.random.default_rng(3)
    blocks = random_blocks(type_name, (64, 1024), rng)
    info = gguf_loader.GGUFTensorInfo("x.weight", (64, 1024), int(Q[type_name]), 0, blocks.nbytes)
    got = dequantize_tensor(blocks.reshape(-1), info)
    reference = gguf.quants.dequantize(blocks, Q[type_name])
    assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))


def test_iq4_xs_decoder_equals_gguf_on_any_bytes():
    """Every byte random, scales included (inf / NaN / subnormal f16 too): the same bits."""
    raw = np.random.default_rng(5).integers(0, 256, (32, 4 * 136), dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        got = gguf_loader._dequantize_iq4_xs(raw)
        reference = gguf.quants.dequantize(raw, Q.IQ4_XS)
    assert got.shape == reference.shape == (32, 1024)
    assert not np.isfinite(reference).all()  # the case is exercised
    assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))


@pytest.mark.parametrize("type_name,raw", [("IQ2_XXS", True), ("TQ1_0", True), ("MXFP4", True), ("I8", False)])
def test_unsupported_type_is_a_value_error_naming_tensor_and_type(type_name, raw, tmp_path):
    qtype = Q[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if raw:
        data = np.random.default_rng(0).integers(0, 256, (2, 256 // block_size * type_size), dtype=np.uint8)
        tensors = {"blk.0.attn_q.weight": (data, qtype)}
    else:
        tensors = {"blk.0.attn_q.weight": (np.arange(512, dtype=np.int8).reshape(2, 256), None)}
    path = str(tmp_path / "x.gguf")
    _write(path, tensors)
    header = read_gguf_header(path)
    assert Q(header.tensors[0].ggml_type).name == type_name
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    with pytest.raises(ValueError, match=rf"'blk\.0\.attn_q\.weight' has type {type_name}, which"):
        dequantize_tensor(blob, header.tensors[0])


def test_unsupported_type_fails_conversion_before_any_weight(tmp_path):
    """One IQ2_XXS tensor in a model: resolve_model raises naming it; the cache stays empty."""
    rng = np.random.default_rng(0)

    def store(name, data):
        if name == "blk.1.ffn_down.weight":
            return rng.integers(0, 256, gguf.quants.quant_shape_to_byte_shape(data.shape, Q.IQ2_XXS),
                                dtype=np.uint8), Q.IQ2_XXS
        return data, None

    path = str(tmp_path / "iq2.gguf")
    write_tiny_gguf("llama", path, encode=store, config_overrides=KQUANT_LLAMA)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"'blk\.1\.ffn_down\.weight' has type IQ2_XXS"):
        resolve_model(path, cache_dir=str(cache))
    assert os.listdir(cache) == []


# --- a tiny Llama in each block type: converted weights and engine output equal transformers' ---

def _storage(type_name: str, rng: np.random.Generator):
    def store(name: str, data: np.ndarray):
        if data.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            return data, None
        return encode(type_name, data, rng, max_abs=0.5)
    return store


PROMPTS = [[1, 50, 60, 70, 80], [1, 5, 9, 30, 200, 7, 3, 12, 13, 14, 15], [1, 100]]
MAX_NEW = 8


@pytest.fixture(scope="module", params=BLOCK_TYPES)
def tiny_llama_in_type(request, tmp_path_factory):
    """(type name, GGUF path, our converted folder, transformers' model loaded from the GGUF)."""
    from transformers import AutoModelForCausalLM

    type_name = request.param
    root = tmp_path_factory.mktemp(f"llama_{type_name}")
    path = str(root / f"tiny-llama-{type_name}.gguf")
    write_tiny_gguf("llama", path, encode=_storage(type_name, np.random.default_rng(11)),
                    config_overrides=KQUANT_LLAMA)
    files = resolve_model(path, cache_dir=str(root / "cache"))
    reference = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).eval()
    return type_name, path, files.folder, reference


def test_tiny_llama_weights_equal_transformers_gguf_loading(tiny_llama_in_type):
    type_name, path, folder, reference = tiny_llama_in_type
    types = {Q(t.ggml_type).name for t in read_gguf_header(path).tensors}
    assert types == {type_name, "F32"}
    ours = dict(iterate_weights(folder))
    ref = reference.state_dict()
    assert set(ours) == set(ref)  # untied: lm_head is stored
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name


def test_tiny_llama_greedy_output_equals_transformers(tiny_llama_in_type):
    """float32 greedy ids equal transformers' generate on the GGUF; logprobs within 1e-4."""
    type_name, path, folder, reference = tiny_llama_in_type
    with torch.inference_mode():
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                       min_new_tokens=MAX_NEW)[0, len(p):].tolist() for p in PROMPTS]
        first_logits = [reference(torch.tensor([p])).logits[0, -1] for p in PROMPTS]
    llm = LLM(path, dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert len({t for e in expected for t in e}) > 3  # not a degenerate (constant) model
    assert [o.outputs[0].token_ids for o in outs] == expected
    worst, top = 0.0, -float("inf")
    for out, logits in zip(outs, first_logits):
        ref_lp = torch.log_softmax(logits, -1)
        for tok, lp in out.outputs[0].logprobs[0].items():
            worst = max(worst, abs(lp.logprob - ref_lp[tok].item()))
        top = max(top, max(lp.logprob for lp in out.outputs[0].logprobs[0].values()))
    print(f"{type_name}: max |logprob - transformers'| over the top 5 of {len(PROMPTS)} prompts: {worst:.2e} (top logprob {top:.2f})")
    assert worst < 1e-4


# --- tokenizer and chat template from the GGUF's metadata ------------------------------------

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def test_chat_template_comes_from_gguf_metadata(tmp_path):
    path = str(tmp_path / "chat.gguf")
    write_tiny_gguf("llama", path, chat_template=CHAT_TEMPLATE)
    assert read_gguf_header(path).metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    folder = resolve_model(path, cache_dir=str(tmp_path / "cache")).folder
    with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
        assert f.read() == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rendered = tokenizer.get_hf_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert rendered == "<s>[user]hello</s>[assistant]"


def test_no_chat_template_in_metadata_writes_none(tmp_path):
    path = str(tmp_path / "plain.gguf")
    write_tiny_gguf("llama", path)
    folder = resolve_model(path, cache_dir=str(tmp_path / "cache")).folder
    assert not os.path.exists(os.path.join(folder, "chat_template.jinja"))
    assert Tokenizer.from_pretrained(folder).chat_template is None
