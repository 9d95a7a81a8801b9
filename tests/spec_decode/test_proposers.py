"""The engine-side proposers on hand-made token sequences: n-gram prompt lookup and suffix
decoding (the request's own tokens and earlier requests' outputs)."""

from __future__ import annotations

import numpy as np

from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.proposer import earlier_matches
from pagedllm.spec_decode.suffix import SuffixDecodingProposer


def test_earlier_matches_excludes_the_suffix_itself_and_needs_a_follower():
    tokens = np.array([1, 2, 3, 1, 2, 4, 1, 2])
    assert earlier_matches(tokens, 2).tolist() == [0, 3]
    assert earlier_matches(tokens, 3).tolist() == []
    assert earlier_matches(np.array([7, 7, 7]), 1).tolist() == [0, 1]
    assert earlier_matches(tokens, 8).tolist() == []


def test_ngram_takes_the_longest_match_then_the_most_recent_occurrence():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    #        0  1  2  3  4  5  6  7  8  9
    seq = [9, 1, 2, 3, 5, 1, 2, 3, 6, 7, 2, 3]
    # longest suffix with an earlier occurrence: [2, 3] (3-gram [7, 2, 3] never occurred);
    # most recent earlier occurrence at 5..6 (tokens 6, 7, ...) rather than 1..2.
    assert p.propose("r", seq, 3) == [6, 7, 2]
    assert p.propose("r", seq, 1) == [6]
    assert p.propose("r", [1, 2, 3, 4], 3) == []          # no earlier n-gram
    assert NgramProposer(3, 3).propose("r", seq, 3) == []  # [7, 2, 3] is too long to have occurred


def test_ngram_proposal_stops_at_the_end_of_the_sequence():
    p = NgramProposer(1, 2)
    assert p.propose("r", [4, 5, 6, 4, 5], 5) == [6, 4, 5]


def test_suffix_walks_the_most_frequent_continuation_with_its_probability():
    p = SuffixDecodingProposer(max_tree_depth=24, max_cached_requests=0, max_spec_factor=4.0,
                               min_token_prob=0.3)
    # "1 2" was followed by 3 twice and by 8 once: draft 3 (prob 2/3), then 4 (both "1 2 3" went on with 4).
    seq = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 8, 0, 1, 2]
    assert p.propose("r", seq, 2) == [3, 4]
    # min_token_prob above 2/3 stops the walk at once.
    strict = SuffixDecodingProposer(24, 0, 4.0, 0.7)
    assert strict.propose("r", seq, 2) == []


def test_suffix_draft_length_is_bounded_by_spec_factor_and_tree_depth():
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6]
    assert SuffixDecodingProposer(24, 0, 1.0, 0.0).propose("r", seq, 8) == [7, 8]      # 1.0 x match of 2
    assert SuffixDecodingProposer(24, 0, 3.0, 0.0).propose("r", seq, 8) == [7, 8, 9, 10, 11, 12]
    assert SuffixDecodingProposer(4, 0, 3.0, 0.0).propose("r", seq, 8) == [7, 8]       # depth 4 = match 2 + 2


def test_suffix_uses_earlier_requests_outputs_and_evicts_the_oldest():
    p = SuffixDecodingProposer(24, max_cached_requests=1, max_spec_factor=2.0, min_token_prob=0.1)
    p.finish_request("a", [100, 101, 20, 21, 22, 23, 24, 25], num_prompt_tokens=2)   # output 20..25
    assert p.num_cached_requests == 1
    assert p.propose("b", [50, 20, 21, 22], 3) == [23, 24, 25]
    p.finish_request("c", [1, 30, 31, 32, 33, 34], num_prompt_tokens=1)
    assert p.num_cached_requests == 1   # "a" evicted
    assert p.propose("b", [50, 20, 21, 22], 3) == []
    assert p.propose("d", [9, 30, 31, 32], 2) == [33, 34]
    # The request's own tokens win when their draft is more likely.
    assert p.propose("e", [30, 31, 32, 40, 41, 30, 31, 32], 2) in ([40, 41], [33, 34])
