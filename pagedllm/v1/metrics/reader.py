"""The in-memory Prometheus metrics as plain objects (vLLM's ``vllm.v1.metrics.reader``):
``LLM.get_metrics()`` returns one ``Counter`` / ``Gauge`` / ``Histogram`` per metric and label set
of the engine's registry (``pagedllm:`` names, ``metrics/prometheus.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

PREFIX = "pagedllm:"


@dataclass
class Metric:
    """One series: the metric's name and its labels (``model_name``, ``engine``, ...)."""
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows (integer)."""
    value: int


@dataclass
class Vector(Metric):
    """Counters by position (vLLM's speculative-decoding acceptance per position; pagedllm exports
    none yet: the class is here for scripts' ``isinstance`` checks)."""
    values: list[int]


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""
    value: float


@dataclass
class Histogram(Metric):
    """Observations in buckets: ``buckets`` maps each upper bound (``le``, as text, ``"+Inf"``
    included) to the cumulative count; ``count`` equals ``buckets["+Inf"]``; ``sum`` of the values."""
    count: int
    sum: float
    buckets: dict[str, int]


def get_metrics_snapshot(registry: CollectorRegistry) -> list[Metric]:
    """Every ``pagedllm:`` series in ``registry`` now, in registration order.

    Raises:
        RuntimeError: a metric type the reader does not know (a broken invariant).
    """
    collected: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(PREFIX):
            continue
        if family.type == "gauge":
            collected += [Gauge(family.name, dict(s.labels), float(s.value)) for s in family.samples]
        elif family.type == "counter":
            collected += [Counter(family.name, dict(s.labels), int(s.value))
                          for s in family.samples if s.name == family.name + "_total"]
        elif family.type == "histogram":
            series: dict[frozenset, dict] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = series.setdefault(frozenset(labels.items()), {"labels": labels, "buckets": {}})
                if s.name.endswith("_bucket"):
                    entry["buckets"][s.labels["le"]] = int(s.value)
                elif s.name.endswith("_count"):
                    entry["count"] = int(s.value)
                elif s.name.endswith("_sum"):
                    entry["sum"] = float(s.value)
            collected += [Histogram(family.name, e["labels"], e["count"], e["sum"], e["buckets"])
                          for e in series.values()]
        else:
            raise RuntimeError(f"metric {family.name} has type {family.type!r}; the reader knows "
                               "gauge, counter and histogram")
    return collected
