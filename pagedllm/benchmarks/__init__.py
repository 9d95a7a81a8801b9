"""``pagedllm bench``: throughput (offline), serving (online), latency, memory (KV concurrency).

One module per benchmark; ``datasets`` builds seeded workloads, ``metrics`` turns timestamps into
the reported numbers (no torch in either), ``cli`` wires the ``bench`` subcommands.
"""
