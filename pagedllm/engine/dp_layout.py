"""Where the data-parallel ranks run (vLLM's multi-instance / multi-node data parallelism).

With ``data_parallel_size`` D, the ranks 0..D-1 are engine-core replicas. A front end (``LLM``,
``AsyncLLM``, ``pagedllm serve``) runs ranks ``[0, data_parallel_size_local)`` in processes of its
own and, when that is fewer than D, listens at ``tcp://data_parallel_address:data_parallel_rpc_port``
for the others. ``pagedllm serve MODEL --headless -dp D -dpr S -dpl L --data-parallel-address A
--data-parallel-rpc-port P`` runs ranks ``[S, S + L)`` elsewhere (another machine, or another
process) and connects them to that front end (``engine/dp_remote.py``).

As in vLLM, a headless rank builds its engine from its own command line (model, dtype, KV cache and
scheduler flags): the front end sends it requests, never its configuration, so both sides must be
started with the same model and engine flags.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's defaults (``ParallelConfig.data_parallel_master_ip`` / ``data_parallel_rpc_port``).
DEFAULT_DATA_PARALLEL_ADDRESS = "127.0.0.1"
DEFAULT_DATA_PARALLEL_RPC_PORT = 29550


@dataclass(frozen=True)
class DataParallelLayout:
    """Which data-parallel ranks this process runs and where the front end listens.

    Attributes:
        size: D, all ranks (``data_parallel_size``).
        size_local: ranks run by this process (``data_parallel_size_local``, ``-dpl``).
        start_rank: the first of them (``data_parallel_start_rank``, ``-dpr``; 0 for a front end).
        address: the front end's host (``data_parallel_address``, ``-dpa``).
        rpc_port: its tcp port for remote ranks (``data_parallel_rpc_port``, ``-dpp``).
        headless: this process runs engine ranks only (``--headless``), no front end.
    Raises:
        ValueError: naming the flag: a size below 1, ``-dpr`` outside [0, D), ranks past D,
            ``--headless`` without ``-dpr`` >= 1 or without ``--data-parallel-address``, a front end
            with ``-dpr`` (vLLM's hybrid load balancing), a port outside [1, 65535].
    """

    size: int
    size_local: int
    start_rank: int
    address: str
    rpc_port: int
    headless: bool = False

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.size}")
        if self.size_local < 1 or self.size_local > self.size:
            raise ValueError(f"data_parallel_size_local (--data-parallel-size-local) must be in [1, "
                             f"data_parallel_size={self.size}], got {self.size_local}")
        if not 0 <= self.start_rank < self.size:
            raise ValueError(f"data_parallel_start_rank (-dpr) must be in [0, data_parallel_size={self.size}), "
                             f"got {self.start_rank}")
        if self.start_rank + self.size_local > self.size:
            raise ValueError(f"data_parallel_start_rank (-dpr) {self.start_rank} + data_parallel_size_local "
                             f"{self.size_local} exceeds data_parallel_size={self.size}")
        if not 1 <= self.rpc_port <= 65535:
            raise ValueError(f"data_parallel_rpc_port (--data-parallel-rpc-port) must be in [1, 65535], "
                             f"got {self.rpc_port}")
        if self.headless and self.start_rank == 0:
            raise ValueError("--headless needs --data-parallel-start-rank (-dpr) >= 1: rank 0 and up to "
                             "--data-parallel-size-local more run in the front end")
        if not self.headless and self.start_rank != 0:
            raise ValueError(f"data_parallel_start_rank (-dpr) {self.start_rank} without --headless is vLLM's "
                             "hybrid load balancing (a front end per node), which pagedllm does not implement; "
                             "run the other ranks with --headless")

    @classmethod
    def from_engine_args(cls, args, headless: bool = False) -> "DataParallelLayout":
        """The layout ``args`` (an ``EngineArgs``) asks for.

        Raises:
            ValueError: see the class; also ``--headless`` without ``--data-parallel-address``,
                and vLLM's ``data_parallel_external_lb`` / ``data_parallel_hybrid_lb`` (not implemented).
        """
        if getattr(args, "data_parallel_external_lb", False):
            raise ValueError("data_parallel_external_lb (--data-parallel-external-lb) is not supported by pagedllm: "
                             "run one front end with --data-parallel-size-local and --headless ranks instead")
        if getattr(args, "data_parallel_hybrid_lb", False):
            raise ValueError("data_parallel_hybrid_lb (--data-parallel-hybrid-lb) is not supported by pagedllm: "
                             "run one front end with --data-parallel-size-local and --headless ranks instead")
        if headless and args.data_parallel_start_rank is None:
            raise ValueError("--headless needs --data-parallel-start-rank (-dpr): the first rank this process runs")
        if headless and not args.data_parallel_address:
            raise ValueError("--headless needs --data-parallel-address: the front end's host")
        size = args.data_parallel_size
        local = size if args.data_parallel_size_local is None else args.data_parallel_size_local
        return cls(size=size, size_local=local, start_rank=args.data_parallel_start_rank or 0,
                   address=args.data_parallel_address or DEFAULT_DATA_PARALLEL_ADDRESS,
                   rpc_port=(DEFAULT_DATA_PARALLEL_RPC_PORT if args.data_parallel_rpc_port is None
                             else args.data_parallel_rpc_port),
                   headless=headless)

    @property
    def local_ranks(self) -> range:
        """The ranks this process runs."""
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def remote_ranks(self) -> range:
        """For a front end: the ranks that connect over tcp (empty when all are local)."""
        return range(self.size_local, self.size) if not self.headless else range(0)

    @property
    def handshake_address(self) -> str:
        """``tcp://address:rpc_port`` (IPv6 hosts in brackets)."""
        host = f"[{self.address}]" if ":" in self.address and not self.address.startswith("[") else self.address
        return f"tcp://{host}:{self.rpc_port}"
