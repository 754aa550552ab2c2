"""The model runner: the one place that knows the device.

It sizes and allocates the paged KV cache for the device the model is on,
chooses once whether our CUDA kernels run there (model/cuda_ops.py: decode
attention over the paged cache and the KV write; without them, or on the
CPU, attention is torch's), runs the forward pass over a step plan from the
scheduler, and samples the step's rows: where the kernels run, on the
device by the mask-fused sampler (model/device_sampler.py: only tokens come
back to the host), elsewhere on the host by the Rust sampler, which gets the
logits as float32. On CUDA, decode steps replay CUDA graphs, one per
batch-size bucket (model/decode_graphs.py). The engine's step loop calls it
and never touches torch devices itself.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from . import cuda_ops
from .attention import AttentionMetadata
from .decode_graphs import GRAPH_MODES, DecodeGraphs
from .decoder import allocate_kv_cache, cache_values_per_token
from .device_sampler import DeviceSampler
from .loader import LoadedModel
from .state_pool import StatePool
from .native import CPU_STEPS, NativeStep, NotNative, native_decoder

log = logging.getLogger("guided.model")

#: The KV pool on CPU when kv_cache_tokens is not given.
CPU_KV_CACHE_BYTES = 2 << 30
#: On CUDA, the share of the device's memory the process may hold once the
#: KV pool is allocated (the rest is left for activations and other processes).
GPU_MEMORY_UTILIZATION = 0.9
#: On CUDA, memory kept free for the forward pass's activations.
GPU_ACTIVATION_RESERVE_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, loaded: LoadedModel, block_size: int, kv_cache_tokens: int | None,
                 max_num_seqs: int, max_model_len: int, cpu_step: str = "auto", cuda_graphs: str = "auto"):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        mc = loaded.config
        #: the recurrent layers' per-sequence states (None: the model has none), before the KV pool is sized
        mixer = mc.mamba or mc.delta
        self.states = StatePool(mc.state_shape, sum(map(mc.is_recurrent, range(mc.num_layers))), max_num_seqs,
                                self.device, block_size, mixer.conv_kernel) if mixer is not None else None
        if self.states is not None:
            log.info("recurrent state: %.1f MiB per sequence, %d slots (max_num_seqs), its prompt-boundary "
                     "copies and as many snapshots for the prefix cache: %.1f MiB in all",
                     self.states.bytes_per_sequence / 2**20, max_num_seqs,
                     3 * max_num_seqs * self.states.bytes_per_sequence / 2**20)
        tokens = kv_cache_tokens if kv_cache_tokens is not None else \
            min(self._kv_budget_bytes() // self.kv_bytes_per_token(), max_num_seqs * max_model_len)
        self.group = loaded.tensor_group
        if self.group is not None:
            # rank 0's block tables address every rank's cache: the same block count on all
            agreed = self.group.agree_min(tokens)
            if agreed < tokens:
                log.info("KV cache: %d tokens, the most every tensor-parallel rank holds "
                         "(this rank could hold %d)", agreed, tokens)
            tokens = agreed
        if tokens < block_size:
            raise ValueError(f"kv_cache_tokens={tokens} is smaller than one block "
                             f"({block_size} tokens)")
        self.num_blocks = tokens // block_size
        self.kernels = self._choose_kernels()
        #: the step's rows are drawn on the device where the kernels run
        #: (None: by the host's sampler)
        self.sampler: DeviceSampler | None = DeviceSampler("cuda") if self.kernels else None
        graphs = self._graph_mode(cuda_graphs)
        # where decode steps run in buckets, their padding rows' block: one past the scheduler's
        self.kv_caches = allocate_kv_cache(loaded.config, self.num_blocks + (graphs != "off"), block_size,
                                           loaded.kv_dtype, self.device, self.model.num_kv_heads)
        #: the step as native code (model/native.py), where it runs; None: decoder.py
        self.native: NativeStep | None = self._choose_step(cpu_step)
        #: decode steps in batch-size buckets (model/decode_graphs.py); None: every step eager
        self.graphs: DecodeGraphs | None = None
        if graphs != "off":
            if self.native is not None:
                raise ValueError("cuda_graphs='padded' runs the torch step; this CPU step is native "
                                 "(cpu_step='torch' runs the torch step)")
            self.graphs = DecodeGraphs(
                lambda ids, positions, meta: self.model.compute_logits(
                    self.model(ids, positions, self.kv_caches, meta, None)),
                self.device, max_batch=max_num_seqs, max_blocks=-(-max_model_len // block_size),
                block_size=block_size, pad_block=self.num_blocks, max_context_len=max_model_len,
                kernels=self.kernels, native_only=bool(loaded.weight_formats), capture=graphs == "capture")

    def _graph_mode(self, mode: str) -> str:
        """How decode steps run (model/decode_graphs.py): "capture" (CUDA graphs), "padded"
        (their buckets and static buffers, eager) or "off"; a model or device that cannot
        take the mode asked for is said at start: a warning for "auto", an error for "padded"."""
        if mode not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs={mode!r}: one of {', '.join(GRAPH_MODES)}")
        if mode == "off" or mode == "auto" and self.device.type != "cuda":
            return "off"
        mc = self.loaded.config
        why = ("the model is split over tensor-parallel ranks" if self.group is not None else
               "the model keeps a recurrent state per sequence" if self.states is not None else
               "the model has short-convolution layers" if any(map(mc.is_conv, range(mc.num_layers))) else None)
        if why is None and mode == "auto" and not (self.kernels and mc.latent is None
                                                   and mc.head_dim in cuda_ops.HEAD_SIZES):
            why = "decode attention runs in torch here (its shapes follow the longest context)"
        if why is not None:
            if mode == "padded":
                raise ValueError(f"cuda_graphs='padded': {why}")
            log.warning("%s: decode steps run eagerly, without CUDA graphs: %s", self.device, why)
            return "off"
        return "capture" if mode == "auto" else "padded"

    def _choose_step(self, cpu_step: str) -> NativeStep | None:
        if cpu_step not in CPU_STEPS:
            raise ValueError(f"cpu_step={cpu_step!r}: one of {', '.join(CPU_STEPS)}")
        if cpu_step == "torch" or self.device.type != "cpu":
            return None
        if cpu_step == "auto" and not self.loaded.weight_formats:
            # float32 weights stay with torch's GEMMs by default (transformers' parity and its
            # prefill speed); cpu_step="native" runs them natively too
            return None
        try:
            step = native_decoder(self.model, self.device, self.kv_caches)
        except NotNative as why:
            if cpu_step == "native":
                raise
            log.info("the CPU step runs in torch (decoder.py): %s", why)
            return None
        log.info("the CPU step runs as native code (rust/cpu/native_step.rs) with %s weights",
                 "+".join(self.loaded.weight_formats) or "float32")
        return step

    def _choose_kernels(self) -> bool:
        """Whether our CUDA kernels run the attention on this device (said once, at start)."""
        if self.device.type != "cuda":
            return False
        ok, why = cuda_ops.status()
        head = self.loaded.config.head_dim
        if ok and head not in cuda_ops.HEAD_SIZES:
            log.warning("%s: the KV write and sampling run our CUDA kernels (cuda/); decode "
                        "attention runs in torch (SDPA over the gathered KV blocks), as the "
                        "kernel is built for head sizes %s, not %d", self.device,
                        "/".join(map(str, cuda_ops.HEAD_SIZES)), head)
        elif ok:
            log.info("%s: decode attention (sliding windows, soft-caps and sinks included), "
                     "the KV write and sampling run our CUDA kernels (cuda/); prefill attention "
                     "is torch's SDPA", self.device)
        else:
            log.warning("%s: our CUDA kernels cannot run (%s); attention runs in torch "
                        "(SDPA over the gathered KV blocks)", self.device, why)
        return ok

    def _step_threads(self) -> int | None:
        """The torch threads for this step, where not torch's own setting (the
        process's: set for the step and restored after it).

        With quantized weights a step runs torch on one thread: its linears and
        its attention run in the kernels' own threads (rust/threads/pool.rs), and its
        other ops are too small for torch to split, yet torch's idle OpenMP
        threads spin after every op on the cores the kernels need (2-core
        AVX2 EPYC, batch 1: 22 → 53 tok/s; batch 16: 70 → 137).
        Tensor-parallel ranks on one host split its cores.
        """
        if self.loaded.weight_formats:
            return 1
        return self.group.threads if self.group is not None else None

    def release(self, seq_id: int, tokens: list[int] | None = None) -> None:
        """An ended sequence's recurrent state slot back to the pool, its snapshots kept given its
        tokens (where the model has states)."""
        if self.states is not None:
            self.states.release(seq_id, tokens)

    def kv_bytes_per_token(self) -> int:
        mc = self.loaded.config
        element = torch.tensor([], dtype=self.loaded.kv_dtype).element_size()
        return cache_values_per_token(mc, self.model.num_kv_heads) * element

    def _kv_budget_bytes(self) -> int:
        """What the KV pool may take on this device, by default."""
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1 - GPU_MEMORY_UTILIZATION) * total - GPU_ACTIVATION_RESERVE_BYTES
        if budget < self.block_size * self.kv_bytes_per_token():
            raise ValueError(f"{self.device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} "
                             "GiB leaves no room for a KV cache; pass kv_cache_tokens")
        return int(budget)

    def execute(self, plan) -> np.ndarray | torch.Tensor | None:
        """The forward pass of one step (a ``_native.StepPlan``): the KV cache
        is written for every scheduled token, and the logits of the rows that
        sample come back as float32 [R, V], for ``sample()``: on the host, or
        on the device where it samples there (None if no row samples, and on
        tensor-parallel ranks other than 0, which take
        ``parallel.StepArrays``)."""
        if self.native is not None:   # no torch in the step: not even its inference-mode guard
            logits = self.native.forward(plan)
            return logits if len(logits) else None
        return self._torch_step(plan)

    @torch.inference_mode()
    def _torch_step(self, plan) -> np.ndarray | torch.Tensor | None:
        threads, before = self._step_threads(), torch.get_num_threads()
        if threads is not None and threads != before:
            torch.set_num_threads(threads)
        try:
            if self.group is None:
                return self._execute(plan)
            with self.group.step(plan):   # rank 0 sends the step's arrays first
                return self._execute(plan)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def _execute(self, plan) -> np.ndarray | torch.Tensor | None:
        bucket = self.graphs.bucket(plan) if self.graphs is not None else None
        if bucket is not None:
            logits = self.graphs.run(plan, bucket)
            return logits if self.sampler is not None else logits.cpu().numpy()
        dev = self.device
        t = lambda a: torch.from_numpy(a).to(dev, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=t(plan.slot_mapping), block_tables=t(plan.block_tables),
            context_lens=t(plan.context_lens), query_start_loc=t(plan.query_start_loc),
            max_query_len=plan.max_query_len, max_context_len=plan.max_context_len,
            block_size=self.block_size, is_decode_only=plan.is_decode_only, kernels=self.kernels,
            native_only=bool(self.loaded.weight_formats))
        states = self.states.step(plan) if self.states is not None else None
        hidden = self.model(t(plan.input_ids), t(plan.positions), self.kv_caches, meta, states)
        if len(plan.logits_indices) == 0:
            return None
        logits = self.model.compute_logits(hidden[t(plan.logits_indices)])
        if logits is None:
            return None
        if self.sampler is not None:
            return logits.float().contiguous()
        return logits.float().cpu().numpy()

    def sample(self, scheduler, logits):
        """The step's draws (tokens, logprobs, tops: ``Scheduler.sample``'s
        shape) from the logits ``execute`` returned."""
        if isinstance(logits, np.ndarray):
            return scheduler.sample(logits)
        return self._sample_device(scheduler, logits)

    @torch.inference_mode()
    def _sample_device(self, scheduler, logits):
        if scheduler.speculating():   # drafts are checked on the host, row by row
            return scheduler.sample(logits.float().cpu().numpy())
        return self.sampler.sample(scheduler, logits)
