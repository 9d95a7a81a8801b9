"""Request and status enums (no model, no torch)."""

import pytest

from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def test_status_ordering_and_reasons():
    assert not RequestStatus.is_finished(RequestStatus.WAITING)
    assert not RequestStatus.is_finished(RequestStatus.RUNNING)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_STOPPED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH_CAPPED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_ABORTED)
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_STOPPED) == "stop"
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_LENGTH_CAPPED) == "length"
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ABORTED) == "abort"
    assert RequestStatus.get_finished_reason(RequestStatus.RUNNING) is None
    assert FinishReason.STOP == "stop" and FinishReason.LENGTH.value == "length"


def test_request_tokens():
    r = Request("a", [1, 2, 3], SamplingParams(), max_tokens=4, arrival_time=5.0)
    assert r.status == RequestStatus.WAITING
    assert (r.num_tokens, r.num_prompt_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.arrival_time == 5.0 and r.first_token_time is None
    r.append_output_token_ids(7)
    r.append_output_token_ids([8, 9])
    assert r.output_token_ids == [7, 8, 9]
    assert r.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert r.prompt_token_ids == [1, 2, 3]
    assert (r.num_tokens, r.num_output_tokens) == (6, 3)
    assert r.first_token_time is not None
    assert not r.is_finished() and r.get_finished_reason() is None


def test_request_copies_prompt():
    prompt = [1, 2]
    r = Request("a", prompt, SamplingParams(), max_tokens=1)
    r.append_output_token_ids(3)
    assert prompt == [1, 2]


@pytest.mark.parametrize("prompt,max_tokens", [([], 1), ([1], 0), ([1], -3)])
def test_request_rejects_bad_input(prompt, max_tokens):
    with pytest.raises(ValueError):
        Request("a", prompt, SamplingParams(), max_tokens=max_tokens)
