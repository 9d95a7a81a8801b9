"""pagedllm.tokenizer.Tokenizer against transformers.AutoTokenizer on small hand-made tokenizers:
BOS handling, clean-up of spaces, EOS id merging, chat templates."""

from __future__ import annotations

import json
import logging

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from pagedllm.tokenizer import Tokenizer

TEXTS = ["hello world", " hello  world ", "hello, world . it 's", "unknownword", "<eot> hello", ""]
VOCAB_WORDS = ["hello", "world", ",", ".", "it", "'s", "'", "s"]


def _backend(kind: str) -> BackendTokenizer:
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<eot>"]
    if kind == "wordpiece":
        vocab = {t: i for i, t in enumerate(specials + VOCAB_WORDS)}
        tok = BackendTokenizer(models.WordPiece(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
    else:
        letters = sorted(set("".join(VOCAB_WORDS)) | {"▁"})
        merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("▁", "hello"), ("w", "o"),
                  ("r", "l"), ("wo", "rl"), ("worl", "d"), ("▁", "world")]
        vocab = {t: i for i, t in enumerate(specials + letters + ["".join(m) for m in merges])}
        tok = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    tok.add_special_tokens(specials)
    return tok


def _write_folder(path, kind="bpe", post_processor="bos", config_extra=None, files=None):
    tok = _backend(kind)
    if post_processor == "bos":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    elif post_processor == "bos_eos":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", **(config_extra or {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in (files or {}).items():
        (path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _assert_same_as_transformers(folder):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_id == ref.eos_token_id
    assert ours.pad_token_id == ref.pad_token_id
    assert ours.vocab_size == len(ref)
    assert set(ref.all_special_ids) <= ours.all_special_ids
    return ours, ref


@pytest.mark.parametrize("post_processor", ["bos", "bos_eos", None])
def test_post_processor_decides_bos_eos(tmp_path, post_processor):
    folder = _write_folder(tmp_path / "tok", post_processor=post_processor)
    ours, _ = _assert_same_as_transformers(folder)
    ids = ours.encode("hello")
    assert (ids[0] == 1) == (post_processor is not None)
    assert (ids[-1] == 2) == (post_processor == "bos_eos")


def test_add_bos_token_flag_without_post_processor_follows_transformers(tmp_path, caplog):
    folder = _write_folder(tmp_path / "tok", post_processor=None, config_extra={"add_bos_token": True})
    with caplog.at_level(logging.WARNING, logger="pagedllm.tokenizer"):
        ours, _ = _assert_same_as_transformers(folder)
    assert ours.encode("hello")[0] != ours.bos_token_id  # transformers 5 ignores the flag here
    assert "add_bos_token" in caplog.text


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_clean_up_tokenization_spaces(tmp_path, kind):
    folder = _write_folder(tmp_path / "tok", kind=kind, post_processor=None,
                           config_extra={"clean_up_tokenization_spaces": True})
    ours, ref = _assert_same_as_transformers(folder)
    ids = ours.encode("hello , world . it 's", add_special_tokens=False)
    if kind == "wordpiece":  # cleanup applies (transformers skips it for BPE)
        assert ours.decode(ids) == "hello, world. it's"


def test_eos_ids_merge_generation_config_and_end_of_turn(tmp_path):
    tok = _backend("bpe")
    tok.add_special_tokens(["<end_of_turn>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 4}))
    ours = Tokenizer.from_pretrained(str(folder))
    end_of_turn = tok.token_to_id("<end_of_turn>")
    assert ours.eos_token_id == 2
    assert ours.eos_token_ids == [2, 4, end_of_turn]
    assert ours.convert_ids_to_tokens([2, end_of_turn]) == ["</s>", "<end_of_turn>"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.convert_ids_to_tokens([10_000])


def test_chat_template_from_config_and_jinja_file(tmp_path):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    folder = _write_folder(tmp_path / "a", config_extra={"chat_template": template})
    ours = Tokenizer.from_pretrained(folder)
    assert ours.chat_template == template
    hf = ours.get_hf_tokenizer()
    assert hf is ours.get_hf_tokenizer()  # built once
    text = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<user>hi"

    folder = _write_folder(tmp_path / "b", files={"chat_template.jinja": template})
    assert Tokenizer.from_pretrained(folder).chat_template == template
    assert Tokenizer.from_pretrained(_write_folder(tmp_path / "c")).chat_template is None


def test_missing_tokenizer_json_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_pretrained(str(tmp_path))
