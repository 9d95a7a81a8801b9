"""``RayDistributedExecutor``: the engine's workers as Ray actors, so one engine can span the
machines of a Ray cluster (vLLM's ``RayDistributedExecutor``).

Placement: one placement-group bundle per rank (``{"CPU": 1}``, plus ``{"GPU": 1}`` on CUDA),
with ``ParallelConfig.ray_placement_strategy`` ("STRICT_PACK" by default: every rank on one node;
"PACK" or "SPREAD" let the ranks cross nodes). Rank ``r`` runs in the actor of bundle ``r``.

Process group: the rank-0 actor reports its node's IP address and a free TCP port; every actor
then builds the ``Worker`` with ``tcp://<ip>:<port>`` as torch.distributed's rendezvous, so the
gloo (CPU) / NCCL (CUDA) group runs over the network between the actors' nodes. The engine process
is no member of the group; it sends each call to every actor once (the ``SchedulerOutput`` is
``ray.put`` once and shared by reference) and takes the driver rank's result.

Failures: results are collected with ``ray.wait``, so the first actor that raises or dies
(``RayActorError``) is reported at once as ``RuntimeError`` naming the rank, even while the others
block in a collective; the executor then kills every actor, removes the placement group and
refuses later calls.

Ray is an optional dependency (``pip install "pagedllm[ray]"``); ``ray.init()`` is called only if
this process is not connected yet, and then joins the cluster named by Ray's ``RAY_ADDRESS`` or
the one ``ray start`` left on this node, else starts a local one.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from pagedllm.config import CacheConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import MultiRankExecutor
from pagedllm.executor.multiproc import STEP_METHODS
from pagedllm.utils.network_utils import get_open_port

logger = logging.getLogger(__name__)

# Seconds the placement group may take to be placed (resources free in the cluster).
PLACEMENT_GROUP_TIMEOUT_S = 300.0

RAY_MISSING = ("distributed_executor_backend='ray' needs Ray, an optional dependency: "
               "pip install 'pagedllm[ray]' (or pip install ray)")


def import_ray():
    """``ray``, or a clear error naming the extra.

    Raises:
        ImportError: if Ray is not installed.
    """
    try:
        import ray
    except ImportError as e:
        raise ImportError(RAY_MISSING) from e
    return ray


class RayWorkerWrapper:
    """What runs in each Ray actor: a ``Worker`` built on ``init_worker`` and driven by
    ``execute_method`` (the same calls the multiprocess executor sends over its pipes)."""

    def __init__(self) -> None:
        self.worker = None

    def get_node_ip_and_free_port(self) -> tuple[str, int]:
        """This actor's node IP address (Ray's view) and a TCP port free on it right now."""
        import ray

        return ray.util.get_node_ip_address(), get_open_port()

    def init_worker(self, rank: int, configs: tuple, init_method: str) -> int:
        """Build the ``Worker`` for ``rank`` and join the process group at ``init_method``.

        Returns:
            This actor's process id.
        """
        import torch

        from pagedllm.executor.multiproc import threads_per_rank
        from pagedllm.worker.worker import Worker

        model_config, cache_config, scheduler_config, parallel_config, kernel_config = configs
        if model_config.device in (None, "cpu"):
            torch.set_num_threads(threads_per_rank(parallel_config, os.cpu_count()))
        self.worker = Worker(model_config, cache_config, scheduler_config, parallel_config, kernel_config, rank=rank,
                             distributed_init_method=init_method)
        self.worker.init_device()
        return os.getpid()

    def execute_method(self, method: str, packed: tuple[tuple, dict]) -> Any:
        """``Worker.<method>(*args, **kwargs)`` with ``packed = (args, kwargs)``; only the driver
        rank returns ``execute_model``'s output (the others return None).

        Raises:
            RuntimeError: with the worker's traceback if the method raised.
        """
        args, kwargs = packed
        try:
            result = getattr(self.worker, method)(*args, **kwargs)
        except Exception:
            raise RuntimeError(traceback.format_exc()) from None
        if method in STEP_METHODS and not self.worker.parallel.is_driver:
            return None
        return result

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RayDistributedExecutor(MultiRankExecutor):
    """One Ray actor per rank (``tensor_parallel_size x pipeline_parallel_size``) in one placement group.

    Args:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config: see ``Executor``;
            ``model_config.model_folder`` must be readable at the same path on every node.
    Attributes:
        driver_rank: the rank whose ``ModelRunnerOutput`` is returned.
        actors: the actor handles, by rank.
        placement_group: the placement group (one bundle per rank).
    Raises:
        ImportError: (at construction) if Ray is not installed, naming the ``[ray]`` extra.
    """

    uses_in_process_worker = False

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig, kernel_config: KernelConfig) -> None:
        super().__init__(model_config, cache_config, scheduler_config, parallel_config, kernel_config)
        from pagedllm.distributed.parallel_state import driver_rank

        self.ray = import_ray()
        self.world_size = parallel_config.world_size
        self.driver_rank = driver_rank(parallel_config)
        self.actors: list = []
        self.placement_group = None
        self._unread: RayPendingCall | None = None   # the last call started (its results maybe unread)

    def initialize(self) -> None:
        """Place the bundles, start one actor per rank, join the process group, load the weights.

        Raises:
            RuntimeError: if the placement group cannot be placed in time, or an actor fails or
                dies while starting (naming the rank).
        """
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        on_gpu = self.model_config.device not in (None, "cpu")
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if on_gpu else {})}
        strategy = self.parallel_config.ray_placement_strategy
        self.placement_group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_GROUP_TIMEOUT_S)
        if not ready:
            self._fail(f"the Ray placement group ({self.world_size} bundles of {bundle}, {strategy}) was not placed "
                       f"within {PLACEMENT_GROUP_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}")
        actor_cls = ray.remote(RayWorkerWrapper)
        for rank in range(self.world_size):
            options = dict(num_cpus=1, num_gpus=1 if on_gpu else 0,
                           scheduling_strategy=PlacementGroupSchedulingStrategy(
                               placement_group=self.placement_group, placement_group_bundle_index=rank))
            self.actors.append(actor_cls.options(**options).remote())
        ip, port = self._gather([self.actors[0].get_node_ip_and_free_port.remote()], "start")[0]
        init_method = f"tcp://{ip}:{port}"
        configs = (self.model_config, self.cache_config, self.scheduler_config, self.parallel_config,
                   self.kernel_config)
        pids = self._gather([a.init_worker.remote(rank, configs, init_method) for rank, a in enumerate(self.actors)],
                            "init_device")
        logger.info("RayDistributedExecutor: %d actors (tensor_parallel_size=%d, pipeline_parallel_size=%d, %s), "
                    "process group at %s, pids %s, driver rank %d", self.world_size,
                    self.parallel_config.tensor_parallel_size, self.parallel_config.pipeline_parallel_size,
                    strategy, init_method, pids, self.driver_rank)
        self.collective_rpc("load_model")

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | RayPendingCall":
        """Send the step's message to every actor (one object in Ray's store); return the driver's output.

        Args:
            non_block: return a ``RayPendingCall`` at once (the engine asks for it on a step
                whose bitmask follows; an actor runs its calls in order).
        Raises:
            RuntimeError: if an actor died or raised (naming the rank).
        """
        call = self._submit("execute_model", (scheduler_output,), {}, pick_rank=self.driver_rank)
        return call if non_block else call.result()

    def sample_tokens(self, grammar_bitmask, non_block: bool = False) -> "ModelRunnerOutput | RayPendingCall":
        """[structured output] Send the bitmask of the step sent with ``grammar_bitmask_follows``
        to every actor (``Executor.sample_tokens``); the driver's answer is the step's output.

        Raises:
            RuntimeError: if an actor died or raised (naming the rank).
        """
        call = self._submit("sample_tokens", (grammar_bitmask,), {}, pick_rank=self.driver_rank)
        return call if non_block else call.result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every actor; one result per rank.

        Raises:
            RuntimeError: if an actor died or raised, naming the rank.
        """
        return self._submit(method, args, kwargs or {}).result()

    def _submit(self, method: str, args: tuple, kwargs: dict[str, Any],
                pick_rank: int | None = None) -> "RayPendingCall":
        """Start the call on every actor (arguments put in Ray's store once); read it later.
        Calls still unread are read first (in order), so every failure is reported in order."""
        self._check_alive()
        # Pickled once into the object store; Ray hands every actor the value behind the reference.
        packed = self.ray.put((args, kwargs))
        refs = [a.execute_method.remote(method, packed) for a in self.actors]
        call = RayPendingCall(self, refs, method, pick_rank, self._unread)
        self._unread = call
        return call

    def check_health(self) -> None:
        """Raises:
            RuntimeError: if the executor failed or an actor is gone."""
        self._check_alive()
        self._gather([a.__ray_ready__.remote() for a in self.actors], "check_health")

    def shutdown(self) -> None:
        """Stop every actor and remove the placement group (idempotent)."""
        actors, self.actors = self.actors, []
        for actor in actors:
            try:
                self.ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:
                pass
            try:
                self.ray.kill(actor)
            except Exception:
                pass
        self._remove_placement_group()

    # -- internals ------------------------------------------------------------------------

    def _has_workers(self) -> bool:
        return bool(self.actors)

    def _stop_workers_now(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        self._remove_placement_group()

    def _remove_placement_group(self) -> None:
        """Give the placement group's CPU bundles back to the cluster (idempotent, never raises)."""
        if self.placement_group is not None:
            try:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None

    def _gather(self, refs: list, what: str) -> list[Any]:
        """Every result, in order; the first failure (raised or died) fails the executor at once."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"worker rank {rank} (Ray actor) died during {what!r}: {e}")
                except ray.exceptions.RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    self._fail(f"worker rank {rank} (Ray actor) failed during {what!r}:\n{cause}")
        return results


class RayPendingCall:
    """A call started on every actor whose results are read on demand (``result()``), after the
    call before it (``previous``): a step's ``execute_model`` is read before its ``sample_tokens``.
    Its value: the picked rank's result, or the list of every rank's."""

    def __init__(self, executor: RayDistributedExecutor, refs: list, method: str, pick_rank: int | None,
                 previous: "RayPendingCall | None") -> None:
        self._executor, self._refs, self.method, self.pick_rank = executor, refs, method, pick_rank
        self._previous = previous
        self._value: Any = None
        self._done = False

    def done(self) -> bool:
        """True when every actor's result is ready (this call's and the earlier ones')."""
        if self._done:
            return True
        ready, _ = self._executor.ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs) and (self._previous is None or self._previous.done())

    def result(self) -> Any:
        """The value (waiting for it).

        Raises:
            RuntimeError: if an actor died or raised (this call or an earlier unread one).
        """
        if not self._done:
            if self._previous is not None:
                self._previous.result()
                self._previous = None
            results = self._executor._gather(self._refs, self.method)
            self._value = results if self.pick_rank is None else results[self.pick_rank]
            self._done = True
        return self._value
