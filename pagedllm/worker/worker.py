"""The worker: picks the device, loads the weights, sizes and allocates the paged KV cache, and runs
the model runner on each step's message."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import torch
from torch import nn

from pagedllm.config import (DEFAULT_GPU_MEMORY_UTILIZATION, CacheConfig, KernelConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig)
from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID, KVCacheGroups, kv_cache_groups_for
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.external_launcher import init_launcher_context
from pagedllm.distributed.parallel_state import ParallelContext, destroy_parallel_context, init_parallel_context
from pagedllm.layers.bf16_gemm import bf16_module
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.loaders.sharded_state import check_sharded_state, load_rank_state, rank_state_dict, save_rank_state
from pagedllm.loaders.tensorizer_config import TensorizerConfig
from pagedllm.models.registry import get_model_class
from pagedllm.models.utils import process_weights_after_loading
from pagedllm.profiler import ProfilerConfig, WorkerProfiler
from pagedllm.sample.greedy_head import ExactGreedyHead
from pagedllm.utils.torch_utils import set_random_seed
from pagedllm.worker.kernel_plan import KernelPlan, apply_linear, choose_kernel_plan, choose_linear
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.memory import (KVCacheShape, default_cpu_kv_cache_bytes, kv_bytes_from_utilization,
                                    num_blocks_for_budget)

logger = logging.getLogger(__name__)


def resolve_device(device: str | None) -> torch.device:
    """``None`` -> cuda if available, else cpu.

    Raises:
        ValueError: if cuda is asked for and not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available")
    return dev


class _CombinedKVShape:
    """[draft models] ``num_blocks_for_budget``'s view of a block holding the target's and the
    draft's K/V: ``bytes_per_block`` of both, the target's ``block_size``."""

    def __init__(self, target: KVCacheShape, bytes_per_block: int) -> None:
        self.block_size = target.block_size
        self.bytes_per_block = bytes_per_block


def build_model(model_config: ModelConfig, weights, dtype: torch.dtype, device: torch.device,
                ctx: ParallelContext | None = None, kernel_config: KernelConfig | None = None) -> nn.Module:
    """Instantiate the registered architecture without random init (meta device), then load weights.

    Args:
        model_config: the model's architecture (``ModelConfig.from_hf_config``).
        weights: iterable of (HF name, tensor or safetensors slice); or, with
            ``model_config.load_format`` "sharded_state", this rank's sharded-state files
            (``loaders.sharded_state``: the model's own names, this rank's slices); or, with
            "tensorizer", the ``TensorizerConfig`` whose file for this rank is read
            (``loaders.tensorizer``).
        ctx: this rank's tensor / pipeline place (None: the whole model).
        kernel_config: the attention backend, ``cpu_isa`` and fused ops the layers are built with
            (None: ``KernelConfig()``'s defaults).
    Raises:
        ValueError: unsupported architecture, or checkpoint/model name or shape mismatch.
    """
    model = _empty_model(model_config, dtype, device, ctx, kernel_config)
    if model_config.load_format == "sharded_state":
        load_rank_state(model, weights)
        process_weights_after_loading(model)
    elif model_config.load_format == "tensorizer":
        from pagedllm.loaders.tensorizer import load_tensorized

        if load_tensorized(model, weights, ctx.tp_rank if ctx is not None else 0):
            process_weights_after_loading(model)
    else:
        model.load_weights(weights)
    return model.eval()


def _empty_model(model_config: ModelConfig, dtype: torch.dtype, device: torch.device, ctx: ParallelContext | None,
                 kernel_config: KernelConfig | None) -> nn.Module:
    """The registered architecture on ``device`` in ``dtype``, weights uninitialised (RoPE
    tables computed)."""
    model_cls = get_model_class(model_config)
    with torch.device("meta"):
        model = model_cls(model_config, ctx, kernel_config)
    # ``to_empty`` in the model dtype at once (as ``.to_empty(device).to(dtype)`` without the float32
    # allocation and copy; a meta ``.to`` or ``empty_like`` would import sympy through torch's Python reference).
    model = model._apply(lambda t: torch.empty(t.shape, device=device, dtype=dtype if t.is_floating_point() else t.dtype))
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return model


class Worker:
    """One rank: owns the device, the model, the KV cache tensors and the model runner.

    The executor drives it in phases: ``init_device`` -> ``load_model`` ->
    ``determine_num_blocks`` -> ``initialize_cache(num_blocks)`` -> ``execute_model`` per step.
    Every method takes and returns plain data, so a worker process can run it behind an RPC.

    Args:
        model_config, cache_config, scheduler_config, parallel_config: see ``pagedllm.config``;
            ``model_config.model_folder`` names the weights.
        kernel_config: the kernel settings (``config.KernelConfig``) the kernel plan and the
            model's layers are chosen from; None: its defaults.
        rank: this worker's rank among ``parallel_config.world_size`` (with external_launcher:
            torchrun's global ``RANK`` among ``world_size_across_dp``).
        weights: (name, tensor) pairs to load instead of reading ``model_config.model_folder``
            (tests, benchmarks).
        distributed_init_method: torch.distributed's rendezvous URL when the world has more than
            one rank (``executor/multiproc.py`` passes it).
    Attributes:
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim].
        num_blocks: blocks in the pool (after ``initialize_cache``).
        model_runner: the ``ModelRunner`` (after ``initialize_cache``).
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig | None = None, kernel_config: KernelConfig | None = None,
                 rank: int = 0, weights=None, distributed_init_method: str | None = None) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.parallel_config = parallel_config or ParallelConfig()
        self.kernel_config = kernel_config or KernelConfig()
        self.rank = rank
        self._weights = weights
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.model: nn.Module | None = None
        self.model_runner: ModelRunner | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.host_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self._weight_bytes = 0
        self.distributed_init_method = distributed_init_method
        self.parallel: ParallelContext | None = None
        self.kernel_plan: KernelPlan | None = None   # chosen by the first ``load_model``
        self.greedy_head: ExactGreedyHead | None = None
        self.profiler: WorkerProfiler | None = None
        # [draft models] the draft model, its KV geometry and pool (``load_draft_model``).
        self.draft_model: nn.Module | None = None
        self.draft_kv_shape: KVCacheShape | None = None
        self.draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.lora_manager = None   # [LoRA] ``init_lora``
        self.watermark = None   # [watermarking] ``init_watermarking``
        # [hybrid KV cache] the layer groups (``_apply_kv_cache_groups``, after any draft model loads).
        self.kv_cache_groups: KVCacheGroups | None = None

    def init_device(self) -> None:
        """Pick the device, seed the global RNGs with the engine's seed
        (``utils.torch_utils.set_random_seed``); with more than one rank, join the process group
        (gloo on the CPU, NCCL on CUDA, where rank ``r`` takes ``cuda:r``); with external_launcher,
        torchrun's world (``distributed/external_launcher.py``; ``cuda:$LOCAL_RANK``).

        Raises:
            ValueError: if cuda is asked for and not available.
        """
        self.device = resolve_device(self.model_config.device)
        set_random_seed(self.model_config.seed)   # as vLLM's workers: random, numpy and torch global RNGs
        world = self.parallel_config.world_size
        launcher = self.parallel_config.launcher if self.parallel_config.uses_external_launcher else None
        if (world > 1 or launcher is not None) and self.device.type == "cuda" and self.device.index is None:
            local_rank = self.rank if launcher is None else launcher.local_rank
            self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if launcher is not None:   # one rank of torchrun's world
            self.parallel = init_launcher_context(self.parallel_config, self.model_config.num_hidden_layers, backend)
            return
        self.parallel = init_parallel_context(
            self.parallel_config, self.rank, self.model_config.num_hidden_layers, self.distributed_init_method,
            backend)

    def load_model(self) -> None:
        """Choose the kernel plan on a first call (``worker/kernel_plan.py``: dtype, linear layers,
        exact greedy head, attention backend, fused ops; built on a first start, logged once as a
        table), build the model on the device in its dtype, load the weights, and apply the plan.

        Raises:
            ValueError: unsupported architecture, mismatching checkpoint, a kernel setting this CPU
                cannot run, or int8 where fbgemm does not run.
        """
        if self.kernel_plan is None:
            plan = choose_kernel_plan(self.model_config, self.kernel_config, self.device, self.parallel)
            logger.info("%s", plan.table())
            for line in plan.warnings:
                logger.warning("%s", line)
            self.kernel_plan = plan
        self.dtype = self.kernel_plan.dtype
        t0 = time.perf_counter()
        self.model = self._build_unpacked_model()
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # Before packing: the exact greedy head keeps a reference to the head weight as stored.
        head_bytes = self._build_greedy_head()
        linear_bytes = apply_linear(self.model, self.kernel_plan.linear, self.dtype, self.device,
                                    self.scheduler_config.max_num_seqs)
        weight_bytes += head_bytes + linear_bytes
        self._weight_bytes = weight_bytes
        self.weights_load_s = time.perf_counter() - t0
        quant = self.model_config.quantization
        notes = (f", {quant} weights" if quant not in (None, "gguf") else "") \
            + (f"; linear layers {linear_bytes / 2**20:+.0f} MiB" if linear_bytes else "") \
            + (f"; exact greedy head +{head_bytes / 2**20:.0f} MiB" if head_bytes else "")
        logger.info("Model weights: %.1f MiB (%s%s) on %s, loaded in %.2f s", weight_bytes / 2**20,
                    str(self.dtype).replace("torch.", ""), notes, self.device, self.weights_load_s)
        self.kv_shape = KVCacheShape(
            num_layers=self.model.num_layers, num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim, block_size=self.cache_config.block_size,
            dtype_bytes=torch.tensor([], dtype=self.dtype).element_size())

    def _build_unpacked_model(self) -> nn.Module:
        """This rank's model as loaded, before the kernel plan packs its linear layers: from the
        weights given to the worker (once), the rank's sharded-state or tensorizer files, or the checkpoint
        (``load_format`` "dummy": then overwritten with vLLM's dummy weights, uniform in
        [-1e-3, 1e-3])."""
        from pagedllm.loaders import iterate_safetensors_slices, iterate_weights

        weights, self._weights = self._weights, None
        if self.model_config.load_format in ("sharded_state", "tensorizer"):
            weights = self._rank_files(self.model_config)
        elif weights is None:
            # A rank of a split model reads only its slices of each tensor (mmap'd safetensors).
            split = self.parallel_config.world_size > 1
            weights = (iterate_safetensors_slices if split else iterate_weights)(self.model_config.model_folder)
        model = build_model(self.model_config, weights, self.dtype, self.device, self.parallel, self.kernel_config)
        if self.model_config.load_format == "dummy":
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.uniform_(-1e-3, 1e-3)
        return model

    def _sharded_state_files(self) -> list[str]:
        """This rank's files of the sharded state in ``model_config.model_folder``.

        Raises:
            ValueError: as ``loaders.sharded_state.check_sharded_state`` (another layout, a file missing).
        """
        ctx = self.parallel or ParallelContext()
        rank = (ctx.tp_rank, ctx.pp_rank)
        return check_sharded_state(self.model_config.model_folder, ctx.tp_size, ctx.pp_size, ranks=[rank])[rank]

    def _rank_files(self, model_config: ModelConfig) -> list[str] | TensorizerConfig:
        """``build_model``'s ``weights`` for this rank's own files: its sharded-state files, or the
        ``TensorizerConfig`` naming its tensorizer file."""
        if model_config.load_format == "tensorizer":
            return TensorizerConfig(**model_config.model_loader_extra_config)
        return self._sharded_state_files()

    def save_tensorized_model(self, tensorizer_config: dict | TensorizerConfig) -> str:
        """Write this rank's weights with tensorizer (vLLM's ``save_tensorized_model``;
        ``loaders.tensorizer.save_tensorized``) to ``tensorizer_uri`` rendered with the
        tensor-parallel rank: the model as loaded, before packing, rebuilt from the same source
        (the running model holds only packed layouts), so for a moment this rank holds its weights
        twice.

        Args:
            tensorizer_config: a ``TensorizerConfig`` or its ``to_serializable()`` dict; with
                ``encryption_keyfile``, the key already written there.
        Returns:
            The URI written.
        Raises:
            ValueError: ``load_format`` "dummy" (random weights, nothing to save); a bad config.
            ImportError: tensorizer is missing.
        """
        from pagedllm.loaders.tensorizer import save_tensorized

        if self.model_config.load_format == "dummy":
            raise ValueError("save_tensorized_model saves the weights the engine loaded; load_format='dummy' "
                             "has random ones (reload real weights first)")
        config = tensorizer_config if isinstance(tensorizer_config, TensorizerConfig) \
            else TensorizerConfig(**tensorizer_config)
        model = self._build_unpacked_model()
        ctx = self.parallel or ParallelContext()
        try:
            return save_tensorized(rank_state_dict(model), config, ctx.tp_rank)
        finally:
            del model
            gc.collect()

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> list[str]:
        """Write this rank's weights into ``path`` (``loaders.sharded_state``; vLLM's
        ``save_sharded_state``): the model as loaded, before packing, rebuilt from the same
        source for the purpose (the running model holds only packed layouts), so for a moment
        this rank holds its weights twice.

        Args:
            pattern: the file names (``loaders.sharded_state.TP_ONLY_PATTERN`` /
                ``PP_AND_TP_PATTERN``; None: the one for this layout).
            max_size: bytes per file at most (None: one file).
        Returns:
            The paths written.
        Raises:
            ValueError: ``load_format`` "dummy" (random weights, nothing to save), or a bad ``pattern``.
        """
        if self.model_config.load_format == "dummy":
            raise ValueError("save_sharded_state saves the weights the engine loaded; load_format='dummy' "
                             "has random ones (reload real weights first)")
        model = self._build_unpacked_model()
        ctx = self.parallel or ParallelContext()
        try:
            return save_rank_state(model, path, ctx.tp_rank, ctx.tp_size, ctx.pp_rank, ctx.pp_size,
                                   pattern=pattern, max_size=max_size)
        finally:
            del model
            gc.collect()

    def load_draft_model(self, draft_config: ModelConfig, share_embedding: bool = False) -> None:
        """[draft models] Build the draft model (``spec_decode/draft_model.py``) beside the target,
        in the target's dtype, on the driver rank (with one tensor rank, the only one); its KV
        pool comes with ``initialize_cache``. Call after ``load_model``.

        Args:
            draft_config: the draft's ``ModelConfig`` (``draft_model_config``): "self_int8" is
                the target's checkpoint with ``quantization="int8_weight_only"``.
            share_embedding: use the target's token embedding instead of the draft's copy (the
                target's own weights: "self_int8"; kept as is, since weight-only quantization
                leaves the embedding in the model dtype).
        Raises:
            ValueError: unsupported architecture, mismatching checkpoint, or a quantization that
                does not run here.
        """
        from pagedllm.loaders import iterate_weights

        t0 = time.perf_counter()
        # "self_int8" on a sharded state: the driver rank's files (the whole model with one rank).
        weights = self._rank_files(draft_config) if draft_config.load_format in ("sharded_state", "tensorizer") \
            else iterate_weights(draft_config.model_folder)
        draft = build_model(draft_config, weights, self.dtype, self.device,
                            kernel_config=self.kernel_config)
        weight_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
        linear, linear_reason = choose_linear(draft_config, self.kernel_config, self.dtype, self.device)
        weight_bytes += apply_linear(draft, linear, self.dtype, self.device, self.scheduler_config.max_num_seqs)
        shared = False
        if share_embedding:
            mine, theirs = draft.get_input_embeddings(), self.model.get_input_embeddings()
            if type(mine) is type(theirs) and mine.weight.shape == theirs.weight.shape \
                    and mine.weight.dtype == theirs.weight.dtype \
                    and (draft.get_lm_head() is not mine or getattr(draft, "packed_lm_head", None) is not None):
                draft.model.embed_tokens = theirs
                weight_bytes -= mine.weight.numel() * mine.weight.element_size()
                shared = True
        self.draft_model = draft.eval()
        self.draft_kv_shape = KVCacheShape(
            num_layers=draft.num_layers, num_kv_heads=draft.num_kv_heads, head_dim=draft.head_dim,
            block_size=self.cache_config.block_size, dtype_bytes=self.kv_shape.dtype_bytes)
        self._weight_bytes += weight_bytes
        logger.info("Draft model: %.1f MiB (%s, %d layers%s%s; linear layers: %s (%s)), loaded in %.2f s",
                    weight_bytes / 2**20, str(self.dtype).replace("torch.", ""), draft.num_layers,
                    f", {draft_config.quantization} weights" if draft_config.quantization not in (None, "gguf") else "",
                    ", embedding shared with the target" if shared else "", linear.describe(), linear_reason,
                    time.perf_counter() - t0)

    @property
    def bytes_per_block(self) -> int:
        """KV bytes of one block: the target's, plus the draft model's pool when there is one."""
        draft = self.draft_kv_shape.bytes_per_block if self.draft_kv_shape is not None else 0
        return self.kv_shape.bytes_per_block + draft

    def _build_greedy_head(self) -> int:
        """Build the exact greedy head the kernel plan chose (``sample/greedy_head.py``) on the
        model's head weight as stored.

        Returns:
            Bytes it adds: its bf16 / int8 copy, plus an untied head's float weight where packing
            would otherwise drop it (0 when off).
        """
        plan = self.kernel_plan
        if plan.greedy_head is None:
            return 0
        weight = self.model.get_lm_head().weight
        # A bfloat16 model's head: the argmax of the full head's bf16 logits, re-scored on its own GEMM.
        logits_kernel = bf16_module(plan.linear.kind) if self.dtype == torch.bfloat16 else None
        self.greedy_head = ExactGreedyHead(weight, plan.greedy_head, self.scheduler_config.max_num_seqs,
                                           max_rows=plan.greedy_head_max_rows, logits_kernel=logits_kernel)
        extra = self.greedy_head.extra_bytes
        if not self.model.tie_word_embeddings and plan.linear.packed:
            extra += weight.numel() * weight.element_size()  # the packed lm_head replaces it; this keeps it
        return extra

    def determine_num_blocks(self) -> int:
        """KV blocks that fit this worker's budget (``CacheConfig``; a profiling forward on CUDA);
        with a draft model a block holds the target's and the draft's K/V (``bytes_per_block``).

        Raises:
            ValueError: if the budget cannot hold one request of ``max_model_len`` tokens.
        """
        cache_config, scheduler_config = self.cache_config, self.scheduler_config
        groups = self._apply_kv_cache_groups()
        per_request = (lambda n: groups.max_blocks_per_request(n, cache_config.block_size) + 1) \
            if groups.is_hybrid else None   # + 1: the hybrid pool's null block
        shape = self.kv_shape if self.draft_kv_shape is None else _CombinedKVShape(self.kv_shape, self.bytes_per_block)
        if cache_config.num_gpu_blocks_override is not None:
            num = cache_config.num_gpu_blocks_override
            return num_blocks_for_budget(num * shape.bytes_per_block, shape, scheduler_config.max_model_len, per_request)
        if cache_config.kv_cache_memory_bytes is not None:
            budget = cache_config.kv_cache_memory_bytes
        elif self.device.type == "cpu":
            if cache_config.gpu_memory_utilization != DEFAULT_GPU_MEMORY_UTILIZATION:  # the user set it
                logger.info("gpu_memory_utilization=%s does not apply on the CPU; the KV budget comes from "
                            "kv_cache_memory_bytes or PAGEDLLM_CPU_KVCACHE_SPACE",
                            cache_config.gpu_memory_utilization)
            budget = default_cpu_kv_cache_bytes(cache_config.cpu_kvcache_space_bytes)
            if cache_config.cpu_kvcache_space_bytes is None:  # the ranks share one machine's RAM
                budget //= self.parallel_config.ranks_on_this_machine
        else:
            budget = kv_bytes_from_utilization(
                torch.cuda.get_device_properties(self.device).total_memory,
                cache_config.gpu_memory_utilization, self._profile_peak_bytes(scheduler_config))
        return num_blocks_for_budget(budget, shape, scheduler_config.max_model_len, per_request)

    def _apply_kv_cache_groups(self) -> KVCacheGroups:
        """[hybrid KV cache] Choose the layer groups (the engine makes the same choice from the same
        configs) and size a block accordingly: a page of this stage's ``num_tensor_pairs`` layers
        when hybrid (``group_size`` with one stage), of every layer of the stage otherwise."""
        groups = kv_cache_groups_for(self.model_config, self.cache_config,
                                     uses_draft_model=self.draft_model is not None)
        self.kv_cache_groups = groups
        pairs = groups.num_tensor_pairs(*self._stage_layers()) if groups.is_hybrid else self.model.num_layers
        if self.kv_shape.num_layers != pairs:
            self.kv_shape = dataclasses.replace(self.kv_shape, num_layers=pairs)
        return groups

    def _stage_layers(self) -> tuple[int, int]:
        """[start, end) global decoder layers this rank's model holds (its pipeline stage)."""
        start = self.parallel.layer_start
        return start, start + self.model.num_layers

    def determine_num_cpu_blocks(self) -> int:
        """Host blocks for swap preemption: ``swap_space_bytes`` // bytes per block (a page of
        ``num_tensor_pairs`` layers with the hybrid KV cache, whose host block 0 is then the
        host null block) with ``preemption_mode="swap"``, else 0 (no host pool is allocated)."""
        if self.scheduler_config.preemption_mode != "swap":
            return 0
        return self.cache_config.swap_space_bytes // self.kv_shape.bytes_per_block

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Allocate ``num_blocks`` KV blocks per layer (and ``num_cpu_blocks`` host blocks for
        swap preemption, pinned on CUDA) and build the model runner. [draft models] The draft
        model's pool has the same ``num_blocks`` (indexed by the same tables); the host pool holds
        the target's K/V only (a preempted request's draft K/V is recomputed)."""
        self.num_blocks = num_blocks
        groups = self._apply_kv_cache_groups()
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.host_kv_caches = self._allocate_kv_caches(num_cpu_blocks, torch.device("cpu")) if num_cpu_blocks else []
        if num_cpu_blocks:
            logger.info("Swap space: %d host blocks (%.1f MiB)", num_cpu_blocks,
                        num_cpu_blocks * self.kv_shape.bytes_per_block / 2**20)
        max_len = self.scheduler_config.max_model_len
        block_size = self.cache_config.block_size
        draft = None
        draft_note = ""
        if self.draft_model is not None:   # [draft models] the draft's pool: same block ids
            self.draft_kv_caches = self._allocate_kv_caches(num_blocks, shape=self.draft_kv_shape)
            from pagedllm.spec_decode.draft_model import DraftModel

            draft = DraftModel(self.draft_model, self.draft_kv_caches, block_size, self.device,
                               self.model_config.vocab_size, max_len)
            draft_note = (f" (target {self.kv_shape.bytes_per_block} + draft model "
                          f"{self.draft_kv_shape.bytes_per_block} B/block)")
        hybrid_note = ""
        if groups.is_hybrid:
            hybrid_note = (f", hybrid: {groups.num_groups} groups of {groups.group_size} layers, windows "
                           f"{'/'.join('full' if w is None else str(w) for w in groups.sliding_windows)}, "
                           f"{groups.max_blocks_per_request(max_len, block_size)} blocks per request")
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB, %d B/token%s%s); maximum concurrency for "
            "%d-token requests: %.2fx", num_blocks, block_size,
            num_blocks * self.bytes_per_block / 2**20, self.bytes_per_block // block_size, draft_note,
            hybrid_note, max_len, groups.max_concurrency(num_blocks, max_len, block_size,
                                                         self.scheduler_config.max_num_batched_tokens))
        self.model_runner = ModelRunner(self.model, self.kv_caches, block_size, self.device,
                                        self.model_config.vocab_size, seed=self.model_config.seed,
                                        parallel=self.parallel, hidden_size=self.model_config.hidden_size,
                                        dtype=self.dtype, host_kv_caches=self.host_kv_caches,
                                        greedy_head=self.greedy_head, draft=draft,
                                        layer_groups=groups.layer_group(*self._stage_layers())
                                        if groups.num_groups > 1 else None, num_kv_cache_groups=groups.num_groups)
        self.model_runner.lora_manager = self.lora_manager
        self.model_runner.watermark = self.watermark

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step (``ModelRunner.execute_model``), timed into ``parallel.step_times``; while
        profiling, inside a ``pagedllm::execute_model`` range of the trace. None when the step
        waits for its grammar bitmask (``grammar_bitmask_follows``; then ``sample_tokens``)."""
        return self._timed_step("execute_model", self.model_runner.execute_model, scheduler_output, count=True)

    def sample_tokens(self, grammar_bitmask) -> ModelRunnerOutput | None:
        """[structured output] Sample the step ``execute_model`` kept (``ModelRunner.sample_tokens``;
        ``grammar_bitmask``: [R, ceil(vocab_size / 32)] int32 numpy, or None to drop the step),
        timed into the step's ``execute_model`` seconds."""
        return self._timed_step("sample_tokens", self.model_runner.sample_tokens, grammar_bitmask, count=False)

    def _timed_step(self, name: str, fn, arg, count: bool):
        """``fn(arg)`` timed into ``parallel.step_times.execute_model`` (``count``: one more step),
        inside a ``pagedllm::<name>`` profiler range while profiling."""
        t0 = time.perf_counter()
        try:
            if self.profiler is not None and self.profiler.running:
                with torch.profiler.record_function(f"pagedllm::{name}"):
                    return fn(arg)
            return fn(arg)
        finally:
            times = self.parallel.step_times
            times.execute_model += time.perf_counter() - t0
            times.num_steps += int(count)

    def get_step_times(self, reset: bool = False) -> dict:
        """This rank's ``StepTimes`` as a dict (seconds; plus ``rank``, ``pp_rank``, ``tp_rank``
        and ``num_threads``, torch's intra-op threads here); ``reset``: start a new sum after
        reading."""
        times = self.parallel.step_times
        out = dict(vars(times), rank=self.rank, pp_rank=self.parallel.pp_rank, tp_rank=self.parallel.tp_rank,
                   num_threads=torch.get_num_threads())
        if reset:
            times.reset()
        return out

    def start_profile(self, config: ProfilerConfig) -> None:
        """Start recording this rank's steps with ``torch.profiler`` (``profiler.py``)."""
        if self.profiler is None:
            self.profiler = WorkerProfiler(config, self.rank, self.device.type)
        self.profiler.start()

    def stop_profile(self) -> None:
        """Stop recording and write this rank's trace (nothing if not recording)."""
        if self.profiler is not None:
            self.profiler.stop()

    def init_batch_logits_processors(self, classes: list) -> None:
        """Build the class-based logits processors (vLLM V1's ``cls(vllm_config, device,
        is_pin_memory)``, Model Runner V2's ``cls(vllm_config, req_states)``) on the rank that samples and hand them to the model runner (after
        ``initialize_cache``); other ranks build none."""
        from pagedllm.sample.batch_logits_processors import BatchLogitsProcessors
        from pagedllm.sample.logits_processor import VllmConfig

        if not classes or not self.model_runner.is_driver:
            return
        config = VllmConfig(self.model_config, self.cache_config, self.scheduler_config, self.parallel_config,
                            self.kernel_config)
        self.model_runner.set_batch_logits_processors(BatchLogitsProcessors.build(classes, config, self.device,
                                                                                 self.model_runner.vocab_size))
        logger.info("logits processors: %s", ", ".join(c.__name__ for c in classes))

    def add_logits_processors(self, req_id: str, processors) -> None:
        """In-process only: attach a request's logits processors (``ModelRunner.add_logits_processors``)."""
        self.model_runner.add_logits_processors(req_id, processors)

    def check_health(self) -> None:
        """Raises:
            RuntimeError: if the worker has not been initialized."""
        if self.model_runner is None:
            raise RuntimeError("the worker has no model runner: initialize_cache was not called")

    def update_config(self, overrides: dict) -> None:
        """vLLM's ``update_config`` for what a reload reads: ``{"load_config": {"load_format": "auto"}}``
        (with "tensorizer", also ``model_loader_extra_config``: ``TensorizerConfig``'s fields).

        Raises:
            ValueError: another config or field, an unsupported ``load_format``, or a bad
                ``model_loader_extra_config`` (as ``TensorizerConfig.from_extra_config``).
        """
        load = overrides.get("load_config", {})
        unknown = [k for k in overrides if k != "load_config"] + \
            [f"load_config.{k}" for k in load if k not in ("load_format", "model_loader_extra_config")]
        if unknown:
            raise ValueError(f"update_config supports only load_config.load_format and model_loader_extra_config, "
                             f"got {unknown}")
        load_format = load.get("load_format", self.model_config.load_format)
        extra = None
        if load_format == "tensorizer":
            extra = TensorizerConfig.from_extra_config(
                load.get("model_loader_extra_config", self.model_config.model_loader_extra_config),
                self.model_config.model_folder).to_serializable()
        self.model_config = dataclasses.replace(self.model_config, load_format=load_format,
                                                model_loader_extra_config=extra)

    def init_watermarking(self, watermark_config) -> None:
        """Watermark the sampled tokens of the requests whose ``watermarking`` resolved to True
        (``watermarking/sampling.py``; ``watermark_config`` a ``WatermarkConfig``)."""
        from pagedllm.watermarking.sampling import WatermarkSampler

        self.watermark = WatermarkSampler(watermark_config)
        if self.model_runner is not None:
            self.model_runner.watermark = self.watermark

    # -- [LoRA] adapters (lora/worker_manager.py) ----------------------------------------------

    def init_lora(self, lora_config) -> None:
        """Wrap the model's target layers with ``max_loras`` empty adapter slots (after
        ``load_model``, before ``initialize_cache``)."""
        from pagedllm.lora.worker_manager import LoRAWorkerManager

        self.lora_manager = LoRAWorkerManager(self.model, lora_config, self.dtype, self.device)
        if self.model_runner is not None:
            self.model_runner.lora_manager = self.lora_manager

    def add_lora(self, lora_request) -> bool:
        """Load an adapter into the host cache (vLLM's ``add_lora``); False if already there.

        Raises:
            ValueError: LoRA not enabled, or a bad adapter.
        """
        if self.lora_manager is None:
            raise ValueError("add_lora needs enable_lora=True")
        return self.lora_manager.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from its slot and the host cache; False if it was not loaded."""
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        return [] if self.lora_manager is None else self.lora_manager.list_loras()

    def reload_weights(self) -> None:
        """Build the model again from the checkpoint (``model_config.load_format``), in place of
        the current one; the KV cache stays (the engine resets its prefix cache)."""
        self.model = None
        self.greedy_head = None
        gc.collect()
        self.load_model()
        if self.model_runner is not None:
            self.model_runner.model = self.model
            self.model_runner.greedy_head = self.greedy_head

    def shutdown(self) -> None:
        """Stop a running profile (writing its trace), drop the model runner, the KV cache and
        the model; leave the process group."""
        self.stop_profile()
        self.model_runner = None
        self.kv_caches = []
        self.host_kv_caches = []
        self.draft_kv_caches = []
        self.model = None
        self.draft_model = None
        if self.parallel_config.world_size > 1 and not self.parallel_config.uses_external_launcher:
            destroy_parallel_context()   # torchrun's world is the script's: it stays

    def _profile_peak_bytes(self, scheduler_config: SchedulerConfig) -> int:
        """Peak accelerator bytes of a forward over ``max_num_batched_tokens`` tokens with a
        one-block dummy cache (weights + activations)."""
        from pagedllm.attention.ops import build_attention_metadata
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(scheduler_config.max_num_batched_tokens, scheduler_config.max_model_len)
        bs = self.kv_shape.block_size
        num_blocks = -(-n // bs)
        caches = self._allocate_kv_caches(num_blocks)
        md = build_attention_metadata([n], [0], [list(range(num_blocks))], bs, self.device)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), caches, md)
            self.model.compute_logits(hidden[-scheduler_config.max_num_seqs:])
        del caches, hidden
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def _allocate_kv_caches(self, num_blocks: int, device: torch.device | None = None,
                            shape: KVCacheShape | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        s = shape or self.kv_shape
        device = device or self.device
        shape = (num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
        # Host blocks of a CUDA worker are pinned (fast, asynchronous copies).
        pin = device.type == "cpu" and self.device.type == "cuda"
        # Uninitialised on purpose (pages are touched on first write): attention only reads slots
        # written through the slot mapping, and masks (and zeroes) the rest of a gathered block.
        pairs = [(torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin),
                  torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin)) for _ in range(s.num_layers)]
        groups = self.kv_cache_groups
        if s is self.kv_shape and groups is not None and groups.is_hybrid:
            # [hybrid KV cache] num_tensor_pairs pairs; the j-th of a group's layers on this stage
            # uses pair j. The null block is zeroed: a window never reaches it, but a reader that
            # masks late sees zeros.
            for k, v in pairs:
                k[NULL_BLOCK_ID].zero_()
                v[NULL_BLOCK_ID].zero_()
            return [pairs[j] for j in groups.layer_tensor_index(*self._stage_layers())]
        return pairs
