"""InputProcessor: the one place a request's inputs are resolved (strict length check, frozen result,
beam search params, grammar check)."""

import dataclasses

import pytest

from pagedllm.engine.input_processor import (ContextLengthExceededError, InputProcessor, LengthCheck,
                                             PromptTooLongError)
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.grammar import StructuredOutputsError
from pagedllm.tokenizer import Tokenizer

MAX_MODEL_LEN = 16


@pytest.fixture(scope="module")
def processor(tiny_tokenizer_dir):
    return InputProcessor(Tokenizer.from_pretrained(tiny_tokenizer_dir), max_model_len=MAX_MODEL_LEN, vocab_size=300)


def test_without_a_length_check_max_tokens_is_capped(processor):
    out = processor.process([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=100))
    assert out.max_tokens == MAX_MODEL_LEN - 6      # 10 tokens of room
    assert out.params.max_tokens == 100             # the caller's value, untouched
    assert processor.process([1] * 6, SamplingParams()).max_tokens == 10


def test_length_check_rejects_naming_the_field(processor):
    check = LengthCheck("max_completion_tokens", "messages")
    with pytest.raises(ContextLengthExceededError) as e:
        processor.process([1] * 6, SamplingParams(max_tokens=11), check)
    assert e.value.param == "max_completion_tokens"
    assert str(e.value) == ("This model's maximum context length is 16 tokens. However, you requested 17 tokens "
                            "(6 in the messages, 11 in the completion). Please reduce the length of the messages "
                            "or completion.")
    out = processor.process([1] * 6, SamplingParams(max_tokens=10), check)
    assert (out.max_tokens, out.params.max_tokens) == (10, 10)
    # Omitted: what fits; a prompt that fills the context leaves no room.
    assert processor.process([1] * 6, SamplingParams(max_tokens=None), check).params.max_tokens == 10
    with pytest.raises(ContextLengthExceededError, match="your messages has 16 tokens, which leaves no room"):
        processor.process([1] * 16, SamplingParams(max_tokens=None), check)
    with pytest.raises(PromptTooLongError, match="17 tokens long"):
        processor.process([1] * 17, SamplingParams(), check)


def test_prompt_only_request_fits_alone(processor):
    params = SamplingParams(max_tokens=1)
    params._prompt_only = True
    out = processor.process([1] * 16, params, LengthCheck())
    assert (out.max_tokens, out.params.max_tokens) == (1, 1)


def test_processed_input_is_frozen(processor):
    out = processor.process([1, 2], SamplingParams(max_tokens=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.max_tokens = 5


def test_beam_search_params_are_processed_as_a_plain_request(processor):
    out = processor.process([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))
    assert isinstance(out.params, SamplingParams)
    assert (out.prompt_token_ids, out.params.max_tokens, out.max_tokens) == ([1, 2, 3], 4, 4)


def test_grammar_error_names_the_engine_field(processor):
    with pytest.raises(StructuredOutputsError) as e:
        processor.process([1, 2], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
    assert str(e.value).startswith("structured_outputs.regex: ")
    assert e.value.reason == str(e.value)[len("structured_outputs.regex: "):]
