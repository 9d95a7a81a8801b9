"""Shared fixtures: tiny random checkpoints (made with transformers, nothing downloaded), the real
default model's transformers outputs, recorded (tests/golden/). Tests that load the default model
(``@pytest.mark.slow``) build their engine themselves and free it when they end, so that no two
copies stay alive at once."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import shutil
import sys

import pytest

# Keep the test process off any hub and quiet.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CPU KV pool of an engine built without a size (the edge's env var, vLLM's
# VLLM_CPU_KVCACHE_SPACE): 1 GiB instead of min(25% of RAM, 4 GiB). A tiny checkpoint needs
# 768 B per token, so the default 4 GiB made ~700k blocks, ~3 s of block-pool setup per engine.
# Inherited by the servers and ranks the tests start; a test of the default sets its own.
os.environ.setdefault("PAGEDLLM_CPU_KVCACHE_SPACE", "1")
# Keep bytecode caches even where the machine sets PYTHONDONTWRITEBYTECODE (this one does): without
# them each of the run's ~300 Python processes (servers, ranks, examples) compiled every pagedllm
# module again (~0.3 s of CPU each), and each pytest process rewrote and compiled every test module
# again (collecting the slow tier: 28 s of CPU instead of 14 s). For this process and its children.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)



def _share_cores_between_xdist_workers() -> None:
    """Under ``pytest -n N``, give each worker ``cpu_count // N`` intra-op threads (at least 1).
    Left alone, each worker's OpenMP pool takes every core and N pools spin against each other
    (on 2 cores with ``-n 2`` the spec-decode tests ran 1.25x slower). Engines started in their
    own processes set their threads from their config, as before."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    cores = os.cpu_count() or 1
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, cores // workers))


_share_cores_between_xdist_workers()

_LIBC_NAME = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC_NAME), "malloc_trim", None) if _LIBC_NAME else None


def release_memory() -> None:
    """Collect garbage, then give the heap pages it freed back to the OS (glibc's ``malloc_trim``;
    without glibc, only the collection). Without the trim, a freed model's many small tensors stay
    in the process's RSS and add to the next module's peak."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_module():
    """What a module freed (engines, tokenizers, checkpoints) leaves the process when it ends."""
    yield
    release_memory()


@pytest.fixture(scope="session")
def free_memory():
    """``release_memory`` as a fixture (conftest modules are not importable by name)."""
    return release_memory


_CORPUS = """The quick brown fox jumps over the lazy dog. A paged KV cache splits keys and values into
blocks of a fixed number of tokens. Continuous batching admits new requests at every iteration.
Über café naïve — 你好，世界！ 😀 🚀 emoji and CJK text need whole characters. Numbers 0123456789.
""" * 20


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE (vocab ~400) trained here, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer)
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    return str(path)


def _tiny_config(arch: str, vocab_size: int):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.3, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=12, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    if arch == "gemma3":
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=32, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"], query_pre_attn_scalar=32,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    raise ValueError(arch)


# ``_tiny_config``'s tie_word_embeddings per arch (Gemma 3: its config's default, tied).
_TIED_BY_DEFAULT = {"llama": False, "mistral": False, "qwen2": True, "qwen3": False, "gemma3": True}


@pytest.fixture(scope="session")
def save_tiny_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """Function: (transformers model, name) -> a fresh folder with the model saved in it
    (config.json, model.safetensors) and the tiny tokenizer's files beside it."""

    def save(model, name: str) -> str:
        path = tmp_path_factory.mktemp(f"tiny_{name}")
        model.save_pretrained(str(path))
        for f in os.listdir(tiny_tokenizer_dir):
            shutil.copy(os.path.join(tiny_tokenizer_dir, f), path)
        return str(path)

    return save


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tiny_tokenizer_dir, save_tiny_checkpoint):
    """Factory: (arch, tie_word_embeddings=None) -> folder with config.json, model.safetensors and
    the tiny tokenizer.

    Weights are random (seeded) with a large ``initializer_range`` so greedy near-ties are rare.
    ``tie_word_embeddings=False`` gives a tied arch (Gemma 3, Qwen 2) its own random LM head: tied,
    Gemma 3's scaled embedding (x sqrt(hidden)) dominates the residual stream, so its greedy output
    is the last token repeated, whatever the context or the K/V cache hold. Tests that must see the
    context (the hybrid KV cache's windows) ask for the untied head; None keeps the arch's default.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cache: dict[tuple[str, bool | None], str] = {}

    def make(arch: str, tie_word_embeddings: bool | None = None) -> str:
        if tie_word_embeddings == _TIED_BY_DEFAULT[arch]:
            tie_word_embeddings = None   # the default checkpoint
        key = (arch, tie_word_embeddings)
        if key in cache:
            return cache[key]
        from transformers import AutoTokenizer
        vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
        torch.manual_seed(1234)
        config = _tiny_config(arch, vocab)
        if tie_word_embeddings is not None:
            config.tie_word_embeddings = tie_word_embeddings
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch == "gemma3":
            # Gemma norms init to 0 (weight 1 + 0); give them random offsets so the test sees them.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.normal_(0.0, 0.3)
        name = arch if tie_word_embeddings is None else f"{arch}_tied{int(tie_word_embeddings)}"
        cache[key] = save_tiny_checkpoint(model, name)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_greedy():
    """The function ``_hf_greedy`` as a fixture (conftest modules are not importable by name)."""
    return _hf_greedy


def _hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, dtype=None) -> list[list[int]]:
    """Reference: transformers greedy decoding, each prompt alone, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or torch.float32)
    model.eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               min_new_tokens=0, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


@pytest.fixture(scope="session")
def default_model_reference() -> dict:
    """transformers' outputs on the default model, recorded by tests/golden/record_default_model.py
    (weights' sha256, config, tokenizer outputs, float32 and bfloat16 greedy tokens)."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent / "golden" / "default_model.json"
    return json.loads(path.read_text(encoding="utf-8"))


def pytest_configure(config):
    """Under ``-n N`` (the README's parallel tier), in the controller before its workers start:
    compile the C++ kernels this CPU runs, one compiler per core (``worker/kernel_builds.prebuild``).
    Otherwise the workers' first tests compiled them one at a time while the other worker waited on
    the build lock (a cold-cache parallel tier: 551 s, 409 s with the kernels built; the prebuild
    itself 72.5 s on 2 cores). A warm cache costs about a second. ``PAGEDLLM_TEST_PREBUILD=0`` turns
    it off (the kernels then build at their first use, as before); so do the options that run no
    test. A failure here only warns: the workers build what they need themselves."""
    workers = getattr(config.option, "numprocesses", None) or 0
    if isinstance(workers, str):  # "auto" / "logical" before xdist resolves them: one per core
        workers = os.cpu_count() or 1
    if hasattr(config, "workerinput") or workers < 2 or os.environ.get("PAGEDLLM_TEST_PREBUILD") == "0":
        return
    if any(getattr(config.option, name, False) for name in ("collectonly", "help", "markers", "showfixtures",
                                                            "show_fixtures_per_test", "setupplan", "setuponly")):
        return
    try:
        from pagedllm.worker.kernel_builds import prebuild

        result = prebuild()
    except Exception as exc:  # noqa: BLE001 - an optimization: report and go on
        sys.stderr.write(f"kernels: prebuild failed ({type(exc).__name__}: {exc}); they build at first use\n")
        return
    if result.built or result.failed:
        sys.stderr.write(result.summary() + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (the README's test command): every test marked ``multiprocess``
    (rank, replica or server processes of a tiny checkpoint, up to ~2.5 GiB summed RSS) joins one
    group, so one xdist worker runs them one at a time while the other takes the rest; every other
    test is grouped by its file, as ``--dist loadfile`` does (module fixtures built once). The
    group goes first so that the longest unit of work starts at once. Other modes: untouched."""
    if config.getoption("dist", "no") != "loadgroup":
        return
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            name = "multiprocess" if item.get_closest_marker("multiprocess") else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(name))
    items.sort(key=lambda item: item.get_closest_marker("multiprocess") is None)


def pytest_ignore_collect(collection_path, config):
    """Under ``-m slow`` (the README's serial tier), a test file whose text never says
    ``mark.slow`` holds no test the tier runs (no hook here adds the marker), so it is not imported:
    collecting the tier took 15 s of CPU importing the ~130 files it then deselected."""
    if (config.getoption("markexpr", "") != "slow" or collection_path.suffix != ".py"
            or not collection_path.name.startswith("test_")):
        return None
    return True if "mark.slow" not in collection_path.read_text(encoding="utf-8") else None
