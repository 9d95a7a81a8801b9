"""Class-based logits processors (vLLM V1's interface): the batch updates a processor sees keep its
per-index state equal to the batch's rows, whatever joins, leaves or reorders."""

from __future__ import annotations

import random

from pagedllm.sample.batch_logits_processors import BatchLogitsProcessors
from pagedllm.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality, process_dict_updates
from pagedllm.sampling_params import SamplingParams


class _Recorder(LogitsProcessor):
    """Keeps {batch index: request id} from the updates alone (what a sparse processor does)."""

    def __init__(self, vllm_config=None, device=None, is_pin_memory=False):
        self.entries: dict[int, str] = {}
        self.updates: list[BatchUpdate | None] = []

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        self.updates.append(batch_update)
        process_dict_updates(self.entries, batch_update,
                             lambda params, prompt, out: (params.extra_args or {}).get("rid"))

    def apply(self, logits):
        return logits


def _rows(ids):
    return [(rid, SamplingParams(extra_args={"rid": rid}), [1], []) for rid in ids]


def test_first_batch_then_no_change_then_leave_and_join():
    rec = _Recorder()
    batch = BatchLogitsProcessors([rec])
    first = batch.update(_rows(["a", "b", "c"]))
    assert first.batch_size == 3 and [a[0] for a in first.added] == [0, 1, 2] and not first.removed and not first.moved
    assert batch.update(_rows(["a", "b", "c"])) is None          # same batch: None, still called
    assert rec.updates[-1] is None
    # b leaves, d joins: d takes b's index; nothing is reported removed.
    up = batch.update(_rows(["a", "d", "c"]))
    assert up.removed == [] and [(i, p.extra_args["rid"]) for i, p, _, _ in up.added] == [(1, "d")] and not up.moved
    # a leaves: the last request fills its hole, one move.
    up = batch.update(_rows(["c", "d"]))
    assert up.batch_size == 2 and up.removed == [0] and up.moved == [(2, 0, MoveDirectionality.UNIDIRECTIONAL)]
    assert rec.entries == {0: "c", 1: "d"}
    # Reordered rows: a swap.
    up = batch.update(_rows(["d", "c"]))
    assert up.moved == [(0, 1, MoveDirectionality.SWAP)] and rec.entries == {0: "d", 1: "c"}
    assert batch.update([]).batch_size == 0 and rec.entries == {}


def test_random_batches_keep_each_processor_in_step():
    rng = random.Random(0)
    rec = _Recorder()
    batch = BatchLogitsProcessors([rec])
    pool = [f"r{i}" for i in range(12)]
    for _ in range(300):
        ids = rng.sample(pool, rng.randint(0, 8))
        up = batch.update(_rows(ids))
        assert rec.entries == dict(enumerate(ids))
        if up is not None:
            assert up.batch_size == len(ids)
            assert not set(up.removed) & {a[0] for a in up.added}   # an added index is never removed


def test_requests_without_state_are_not_tracked():
    rec = _Recorder()
    batch = BatchLogitsProcessors([rec])
    rows = [("x", SamplingParams(), [1], []), *_rows(["y"])]
    batch.update(rows)
    assert rec.entries == {1: "y"}
    batch.update(list(reversed(rows)))
    assert rec.entries == {0: "y"}
