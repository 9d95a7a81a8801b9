"""Where an engine step's wall time goes: per-component seconds over a whole run.

``StepBreakdown`` wraps, for the duration of a ``with`` block, the bound methods of one engine's
own objects (scheduler, model runner, model, sampler, output processor) and of its linear layers
(their ``forward``); everything is restored on exit. Each component's wall time is summed with
``time.perf_counter``. Components nest (the decoder's linear layers run inside the model
forward), so the table reports the exclusive part of each:

- ``linear layers``: every ``nn.Linear`` / ``KernelLinear`` (oneDNN, int8) of the decoder (its
  ``forward`` wrapped on the instance);
- ``LM head``: ``model.compute_logits`` and the exact greedy head's ``argmax`` (``--exact-greedy-head``);
- ``attention``: each layer's ``Attention`` call (KV write + paged attention);
- ``model forward, other``: the forward minus the two above (norms, RoPE, activations, residual
  adds, embedding);
- ``sampler``;
- ``grammar mask apply``: [structured output] the worker's ``apply_step_bitmask`` (the bitmask
  to a tensor, -inf on the forbidden logits);
- ``model runner, other``: ``execute_model`` (and ``sample_tokens``, a split step's second half) minus forward, LM head, sampler and mask apply
  (input tensors, attention and sampling metadata, copying results to Python);
- ``grammar bitmask fill``: [structured output] ``StructuredOutputManager.grammar_bitmask`` in
  the engine (the backend fills one row per constrained request that samples);
- ``fill beside the forward``: [structured output] minus the part of the fill that ran while
  the step's forward ran on the forward thread (``LLMEngine._submit_step``: the steps with
  constrained rows), so that the rows still sum to the wall time; ``grammar bitmask fill`` plus
  this row is the fill's share of the wall time;
- ``grammar accept``: [structured output] the matchers advancing by the sampled tokens (inside
  ``update_from_output``);
- ``scheduler``: ``schedule`` + ``update_from_output`` minus grammar accept;
- ``output processing``: detokenization, stop strings, ``RequestOutput`` objects;
- ``engine, other``: the rest of ``LLMEngine.step``, and ``generate`` outside the steps.

The wrappers cost about a microsecond per call, so an instrumented run is slightly slower than a
plain one; take throughput from a plain run.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import ExitStack


class _Timed:
    """A callable proxy that adds its wall time to ``totals[key]`` and, given ``spans``, appends
    each call's (start, end) ``perf_counter`` seconds to it."""

    def __init__(self, fn, totals: Counter, key: str, spans: list | None = None) -> None:
        self._fn, self._totals, self._key, self._spans = fn, totals, key, spans

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            self._totals[self._key] += t1 - t0
            if self._spans is not None:
                self._spans.append((t0, t1))


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds during which a span of ``a`` and a span of ``b`` both ran; each list holds
    (start, end) spans in start order that do not overlap each other (one thread's calls)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class StepBreakdown:
    """Context manager timing the components of ``llm_engine`` (an ``LLMEngine``).

    Usage::

        with StepBreakdown(llm.llm_engine) as bd:
            t0 = time.perf_counter(); llm.generate(...); bd.wall_s = time.perf_counter() - t0
        bd.table()  # [(component, seconds, share of wall)]
    """

    def __init__(self, llm_engine) -> None:
        self.engine = llm_engine
        self.totals: Counter[str] = Counter()
        self.wall_s = 0.0
        self._stack = ExitStack()
        # (start, end) of each bitmask fill and of each model runner execute_model (a split
        # step's forward runs on the forward thread, beside the fill).
        self._fill_spans: list[tuple[float, float]] = []
        self._forward_spans: list[tuple[float, float]] = []

    def _patch(self, obj, attr: str, key: str, spans: list | None = None) -> None:
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, _Timed(getattr(obj, attr), self.totals, key, spans))

        def restore():
            if had:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)
        self._stack.callback(restore)

    def __enter__(self) -> "StepBreakdown":
        from torch import nn

        from pagedllm.attention import Attention
        from pagedllm.layers.kernel_linear import KernelLinear

        eng = self.engine
        worker = eng.executor.local_worker
        if worker is None:
            raise ValueError("--breakdown needs the in-process executor (tensor_parallel_size=1, "
                             "pipeline_parallel_size=1, distributed_executor_backend=None)")
        runner = worker.model_runner
        model = runner.model
        self._patch(eng, "step", "step")
        self._patch(eng.scheduler, "schedule", "scheduler")
        self._patch(eng.scheduler, "update_from_output", "scheduler")
        self._patch(eng.output_processor, "process_outputs", "output processing")
        self._patch(runner, "execute_model", "execute_model", self._forward_spans)
        self._patch(runner, "sample_tokens", "execute_model")
        self._patch(runner, "sampler", "sampler")
        self._patch(model, "forward", "forward")
        self._patch(model, "compute_logits", "LM head")
        if getattr(runner, "greedy_head", None) is not None:   # the exact greedy head is the LM head too
            self._patch(runner.greedy_head, "argmax", "LM head")
        self._patch_structured_output()
        for qualname, module in model.named_modules():
            for name, child in list(vars(module).items()):
                if isinstance(child, Attention):
                    self._patch(module, name, "attention")
            if qualname in ("lm_head", "packed_lm_head"):
                continue  # timed as the LM head
            if isinstance(module, (nn.Linear, KernelLinear)):
                # The instance's ``forward`` wrapped, not forward hooks: a module with hooks takes
                # ``nn.Module.__call__``'s slow path, ~2 us more per call, which the table would
                # report as "model forward, other" (~0.15 ms a batch-1 step of the default model).
                self._patch(module, "forward", "linear layers")
        return self

    def _patch_structured_output(self) -> None:
        """Time the grammar work: the engine's bitmask fill, the worker's mask apply (a name the
        model runner module imported) and the matchers' accept (the handle class's method)."""
        from pagedllm.structured_output.request import StructuredOutputRequest
        from pagedllm.worker import model_runner

        manager = getattr(self.engine, "structured_output_manager", None)
        if manager is not None:
            self._patch(manager, "grammar_bitmask", "grammar bitmask fill", self._fill_spans)
        self._patch_attr(model_runner, "apply_step_bitmask", "grammar mask apply")
        self._patch_attr(StructuredOutputRequest, "accept_tokens", "grammar accept", method=True)

    def _patch_attr(self, owner, attr: str, key: str, method: bool = False) -> None:
        """Wrap a module function or a class's method (restored on exit)."""
        old = getattr(owner, attr)
        if method:
            totals = self.totals

            def timed(handle, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return old(handle, *args, **kwargs)
                finally:
                    totals[key] += time.perf_counter() - t0
            setattr(owner, attr, timed)
        else:
            setattr(owner, attr, _Timed(old, self.totals, key))
        self._stack.callback(setattr, owner, attr, old)

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def table(self) -> list[tuple[str, float, float]]:
        """(component, seconds, fraction of ``wall_s``) rows, exclusive times, in pipeline
        order; the rows sum to ``wall_s``."""
        t = self.totals
        rows = [
            ("linear layers", t["linear layers"]),
            ("LM head", t["LM head"]),
            ("attention", t["attention"]),
            ("model forward, other", t["forward"] - t["linear layers"] - t["attention"]),
            ("sampler", t["sampler"]),
            ("grammar mask apply", t["grammar mask apply"]),
            ("model runner, other", t["execute_model"] - t["forward"] - t["LM head"] - t["sampler"]
             - t["grammar mask apply"]),
            ("grammar bitmask fill", t["grammar bitmask fill"]),
            ("fill beside the forward", -overlap_s(self._fill_spans, self._forward_spans)),
            ("grammar accept", t["grammar accept"]),
            ("scheduler", t["scheduler"] - t["grammar accept"]),
            ("output processing", t["output processing"]),
        ]
        rows.append(("engine, other", self.wall_s - sum(s for _, s in rows)))
        wall = self.wall_s or 1.0
        return [(name, s, s / wall) for name, s in rows]

    def as_dict(self) -> dict[str, float]:
        """``{component: seconds}`` plus ``wall_s``."""
        out = {name: s for name, s, _ in self.table()}
        out["wall_s"] = self.wall_s
        return out


# -- per rank (every executor; the only view into worker processes) ----------------------------

RANK_TIME_KEYS = ("all_reduce", "all_gather", "send", "recv")


def read_rank_times(executor, reset: bool = False) -> list[dict]:
    """Every rank's ``StepTimes`` (``Worker.get_step_times``) through ``executor.collective_rpc``:
    seconds in ``execute_model`` and, inside it, in all-reduce / all-gather / send / recv.

    Args:
        reset: start new sums on the ranks after reading (call once before the timed run).
    Returns:
        One dict per rank, in rank order.
    """
    return executor.collective_rpc("get_step_times", (reset,))


def format_rank_times(ranks: list[dict], wall_s: float) -> str:
    """A table, one row per rank: its step time (``execute_model``) and that time's share of
    ``wall_s`` (busy), then each collective's seconds and share of the rank's step time."""
    wall = wall_s or 1.0
    head = f"{'rank':>4} {'stage':>5} {'tp':>3} {'thr':>3} {'steps':>6} {'step s':>8} {'busy':>6}"
    for key in RANK_TIME_KEYS:
        head += f" {key.replace('_', '-'):>16}"
    lines = ["---- per rank: step time and the share of it in communication ----", head]
    for r in ranks:
        step = r["execute_model"] or 1e-12
        row = (f"{r['rank']:>4} {r['pp_rank']:>5} {r['tp_rank']:>3} {r['num_threads']:>3} {r['num_steps']:>6} "
               f"{r['execute_model']:>8.2f} {100 * r['execute_model'] / wall:>5.1f}%")
        for key in RANK_TIME_KEYS:
            row += f" {r[key]:>7.2f} s {100 * r[key] / step:>5.1f}%"
        lines.append(row)
    lines.append("(recv includes waiting for the previous stage; all-reduce, waiting for the slowest rank)")
    return "\n".join(lines)
