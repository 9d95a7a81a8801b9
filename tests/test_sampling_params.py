"""SamplingParams: every validation rule raises a ValueError naming its field; normalization."""

from __future__ import annotations

import pytest

from pagedllm.sampling_params import SamplingParams

BAD = [
    ("n", dict(n=0)),
    ("n", dict(n=1.5)),
    ("best_of", dict(n=2, best_of=1)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature=float("inf"))),
    ("temperature", dict(temperature="1.0")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=float("nan"))),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.1)),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=True)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=float("nan"))),
    ("max_tokens", dict(max_tokens=-1)),
    ("max_tokens", dict(max_tokens=True)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[1])),
    ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=["a"])),
    ("logit_bias", dict(logit_bias={1: 101.0})),
    ("logit_bias", dict(logit_bias={1: float("nan")})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={"x": 1.0})),
    ("logit_bias", dict(logit_bias=[1, 2])),
    ("allowed_token_ids", dict(allowed_token_ids=[])),
    ("allowed_token_ids", dict(allowed_token_ids=[-3])),
    ("bad_words_token_ids", dict(bad_words_token_ids=[-1])),
    ("logits_processors", dict(logits_processors=["not callable"])),
]


@pytest.mark.parametrize("field,kwargs", BAD, ids=[f"{f}-{kw}" for f, kw in BAD])
def test_invalid_value_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_are_valid_and_vllm_like():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert p.max_tokens == 16
    assert p.stop == [] and p.stop_token_ids == [] and not p.sampling_type_greedy


def test_normalization():
    p = SamplingParams(stop="END", stop_token_ids=(5, 6), top_k=None, logit_bias={"7": 2})
    assert p.stop == ["END"] and p.stop_token_ids == [5, 6] and p.top_k == 0
    assert p.logit_bias == {7: 2.0}
    assert p.all_stop_token_ids == {5, 6}


def test_greedy_resets_sampling_knobs():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert p.sampling_type_greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_boundary_values_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   logit_bias={0: -100.0, 1: 100.0}, min_tokens=4, max_tokens=4, logprobs=0,
                   seed=-5)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_update_from_model_and_ignore_eos():
    p = SamplingParams(stop_token_ids=[9])
    p.update_from_model([1, 106])
    assert p.all_stop_token_ids == {1, 106, 9} and p.eos_token_ids == (1, 106)
    q = SamplingParams(stop_token_ids=[9], ignore_eos=True)
    q.update_from_model([1])
    assert q.all_stop_token_ids == {9} and q.eos_token_ids == (1,)


def test_clone_is_independent_for_model_update():
    p = SamplingParams()
    q = p.clone()
    q.update_from_model([1])
    assert p.all_stop_token_ids == set() and q.all_stop_token_ids == {1}
