"""A tiny Llama whose next-token distributions are broad (small initializer range), and a
word-level tokenizer (``w0`` .. ``w511``) whose text re-encodes to the same ids."""

from __future__ import annotations

import os

import pytest

VOCAB = 512


@pytest.fixture(scope="session")
def wordlevel_tokenizer_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("wordlevel_tokenizer")
    tok.save(os.path.join(str(path), "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="session")
def broad_llama_dir(tmp_path_factory, wordlevel_tokenizer_dir) -> str:
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.02, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                      tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("broad_llama"))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    shutil.copy(os.path.join(wordlevel_tokenizer_dir, "tokenizer.json"), path)
    return path
