"""The drafts' sizing rule (``spec_decode/controller.py``): the acceptance bar from the step-time
model, per-request acceptance, probing, ``disable_by_batch_size``, and the counts."""

from __future__ import annotations

import math

import pytest

from pagedllm.config import SpeculativeConfig
from pagedllm.spec_decode.controller import PROBE_INTERVAL, SpecDecodeController, StepTimeModel


def controller(**kw) -> SpecDecodeController:
    return SpecDecodeController(SpeculativeConfig(method="ngram", num_speculative_tokens=6, **kw), None)


def test_step_time_model_recovers_a_linear_cost():
    model = StepTimeModel()
    for n in [1, 2, 5, 3, 1, 6, 4] * 5:
        model.observe(n, 0.040 + 0.004 * n)        # W = 40 ms, t = 4 ms
    # bar = t / (W / B + t)
    assert model.token_cost_ratio(1) == pytest.approx(0.004 / (0.040 + 0.004), rel=1e-6)
    assert model.token_cost_ratio(16) == pytest.approx(0.004 / (0.040 / 16 + 0.004), rel=1e-6)
    assert StepTimeModel().token_cost_ratio(1) == pytest.approx(0.25 / 1.25)   # the prior before data


def test_draft_length_is_the_largest_k_whose_last_draft_passes_the_bar():
    c = controller()
    for n in [1, 2, 5, 3, 1, 6, 4] * 5:
        c.observe_step(n, 0.040 + 0.004 * n)
    c.begin_step(num_running=1)
    bar = 0.004 / 0.044
    # Prior acceptance 1/2: 0.5**k >= bar for k <= 3.
    assert c.num_drafts("r") == int(math.log(bar) / math.log(0.5)) == 3
    c.record("r", num_drafts=6, num_accepted=6)        # (6 + 1) / (6 + 2) = 0.875
    assert c.num_drafts("r") == 6
    c.begin_step(num_running=64)                         # bar 0.004 / (0.040/64 + 0.004) = 0.865
    assert c.num_drafts("r") == 1
    c.record("r", 1, 0)
    c.record("r", 1, 0)                                  # acceptance (6+1)/(8+2) = 0.7 < 0.865
    assert c.num_drafts("r") == 0


def test_a_request_that_stopped_drafting_probes_again():
    c = controller()
    c.begin_step(num_running=1)
    for _ in range(10):
        c.record("r", 3, 0)                              # acceptance 1/12
    assert c.num_drafts("r") == 0
    for _ in range(PROBE_INTERVAL):
        c.skipped("r")
    assert c.num_drafts("r") == 1


def test_disable_by_batch_size_and_non_adaptive():
    c = controller(disable_by_batch_size=4)
    c.begin_step(num_running=5)
    assert c.num_drafts("r") == 0
    c.begin_step(num_running=1)
    assert c.num_drafts("r") > 0
    fixed = controller(adaptive=False, disable_by_batch_size=None)
    fixed.begin_step(num_running=1000)
    fixed.record("r", 6, 0)
    assert fixed.num_drafts("r") == 6


def test_counts_per_position_and_the_vllm_figures():
    c = controller()
    c.record("a", 4, 2)
    c.record("b", 2, 2)
    c.record("c", 0, 0)                                  # no drafts: not a draft
    s = c.stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (2, 6, 4)
    assert s.num_accepted_tokens_per_pos == [2, 2, 0, 0, 0, 0]
    assert s.acceptance_rate == pytest.approx(4 / 6)
    assert s.mean_acceptance_length == pytest.approx(1 + 4 / 2)
    c.finish_request("a", [1, 2, 3], 1)
    assert "a" not in c._history
