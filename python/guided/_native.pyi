"""Native core of guided (Rust): scheduler, paged KV blocks with prefix caching, sampling.

One engine step is ``schedule()`` → ``start_masks()`` → forward pass →
``sample()`` → ``update()``.
Call ``update()`` after every plan whose ``logits_indices`` is non-empty. A
plan with no sampling rows needs no ``update()`` (``update(empty)`` is also
fine); a plan left without its ``update()`` is dropped at the next
``schedule()`` and its sampling rows are fed again. If the forward pass fails,
``abort()`` the plan's sequences before scheduling again: their blocks enter
the prefix cache only once a later call confirms the pass ran.
"""

import os
from typing import Callable, Self, Sequence, TypeAlias, final

import numpy as np
import numpy.typing as npt

from guided.model.layer_kinds import Activation, NormKind, NormPlacement, QkNorm, Scoring
from guided.sampling_params import SamplingParams

__all__ = ["CpuDecoder", "DeviceRows", "Grammar", "GrammarCompiler", "Matcher", "NativeAttention", "NativeLayer", "NativeLinear",
           "NativeMlp", "NativeMoe", "NativeShortConv", "NativeSpec", "PackedFile", "QuantMatrix", "Scheduler", "StepOutput", "StepPlan",
           "check_sample_params", "cpu_paged_attention", "cuda_adjust_logits", "cuda_kernel_files", "cuda_masked_sample",
           "cuda_paged_decode", "cuda_status", "cuda_write_kv", "ggml_quantize", "packed_kernels", "quant_formats", "quant_kernels",
           "reference_adjust_logits", "reference_masked_sample", "reference_paged_decode"]

#: a torch tensor as the CUDA launchers take it (python/guided/cuda_ops.py):
#: (data_ptr, shape, dtype, device, contiguous)
_TensorArg = tuple[int, list[int], str, str, bool]

#: host values the adjust reference takes as int32 / float32 entries
_Ints = npt.NDArray[np.int32] | list[int]
_Floats = npt.NDArray[np.float32] | list[float]
_F32: TypeAlias = npt.NDArray[np.float32]

@final
class DeviceRows:
    """One step's ``R`` sampling rows as the device sampler reads them
    (read-only numpy arrays; rust/cuda/device_sampling.rs)."""

    mask: npt.NDArray[np.int32] | None
    """[R, ceil(V / 32)] packed bits (an unconstrained row allows all); None
    when no row has a grammar."""
    temperature: npt.NDArray[np.float32]
    top_k: npt.NDArray[np.int32]
    top_p: npt.NDArray[np.float32]
    min_p: npt.NDArray[np.float32]
    seeds: npt.NDArray[np.uint64]
    """[R] each sequence's seed."""
    steps: npt.NDArray[np.uint64]
    """[R] each draw's place in its sequence's stream."""
    entry_rows: npt.NDArray[np.int32]
    """[E] one entry per (row, token) a penalty, bias or ban changes."""
    entry_tokens: npt.NDArray[np.int32]
    entry_seen: npt.NDArray[np.int32]
    """[E] 1 where the token is in the prompt or output (repetition penalty)."""
    entry_counts: npt.NDArray[np.int32]
    """[E] the token's count in the output (frequency and presence)."""
    entry_bias: npt.NDArray[np.float32]
    """[E] the summed logit bias; -inf bans."""
    repetition: npt.NDArray[np.float32]
    frequency: npt.NDArray[np.float32]
    presence: npt.NDArray[np.float32]
    host: npt.NDArray[np.bool_]
    """[R] rows the host samples (they ask for top logprobs)."""

@final
class StepPlan:
    """Flat arrays for one forward pass (read-only; created once per step).

    ``B`` rows (sequences) in plan order, ``T`` tokens, ``R`` rows that sample.
    """

    input_ids: npt.NDArray[np.int64]
    """[T] token ids of every row's chunk, rows concatenated."""
    positions: npt.NDArray[np.int64]
    """[T] position of each token in its sequence."""
    slot_mapping: npt.NDArray[np.int64]
    """[T] KV slot to write each token to: block_id * block_size + offset."""
    block_tables: npt.NDArray[np.int32]
    """[B, M] physical blocks of each row, padded with 0."""
    context_lens: npt.NDArray[np.int32]
    """[B] tokens with KV after this step (cached + earlier chunks + this chunk)."""
    query_start_loc: npt.NDArray[np.int32]
    """[B + 1] where each row's chunk starts in ``input_ids``; the last entry is T."""
    seq_ids: npt.NDArray[np.int64]
    """[B] sequence id of each row."""
    logits_indices: npt.NDArray[np.int64]
    """[R] index into T of the last token of each row that samples this step."""
    sample_seq_ids: npt.NDArray[np.int64]
    """[R] sequence id of each sampling row (the row order of ``sample``/``update``)."""
    max_query_len: int
    max_context_len: int
    is_decode_only: bool
    """True when every row feeds exactly one token."""
    num_tokens: int
    """T."""

@final
class StepOutput:
    """What ``Scheduler.update()`` did for one sampling row (read-only)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def token(self) -> int:
        """The token appended; -1 when none was (the mask allowed nothing, or
        the grammar rejected it)."""
    @property
    def finish_reason(self) -> str | None:
        """None (still running), "stop" (an end token, unless ignore_eos, or
        a stop token, or the grammar is complete), "length" (max_tokens, or
        the sequence reached max_model_len or the KV pool's size) or "error"
        (``error`` says why)."""
    @property
    def num_cached_tokens(self) -> int:
        """The request's prefix-cache hit at first admission."""
    @property
    def forced(self) -> list[int]:
        """Tokens the grammar forced after ``token``, appended without sampling."""
    @property
    def closed(self) -> bool:
        """The budget's closing wrote the end of the output (see
        ``Scheduler.add_request``'s ``close_on_length``)."""
    @property
    def closing_us(self) -> int:
        """On the row that finished a closing request: microseconds its
        closing took in all (first search, fit checks, searches); else 0."""
    @property
    def more(self) -> list[int]:
        """With a draft (speculative decoding): the tokens later draws of the
        step appended after ``forced``, ``more_forced`` of them forced."""
    @property
    def more_forced(self) -> int: ...
    @property
    def error(self) -> str | None: ...

@final
class Scheduler:
    """Continuous batching over a paged KV cache of ``num_blocks`` blocks.

    Each step runs decodes and unfinished prefill chunks first, then admits
    waiting requests in FIFO order (with a prefix-cache lookup), within
    ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences. When
    blocks run out the most recently admitted sequence is preempted and later
    recomputed. Raises ValueError on a bad configuration.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        enable_prefix_caching: bool = True,
        speculative: bool = False,
        num_speculative_tokens: int = 0,
        drafter: str = "lookup",
        masks: str = "overlap",
    ) -> Self:
        """``speculative``: whether requests that do not say speculate;
        ``num_speculative_tokens``: the most tokens a step looks up for one
        sequence (0: never); ``drafter``: "lookup" or "random:SEED"
        (rust/engine/speculative.rs). ValueError on another drafter.
        ``masks``: "overlap" (every constrained row's mask computed by
        ``start_masks()``) or "on_demand" (a row whose draw the mask can only
        change by refusing its token is drawn without it by ``sample()``, and
        its mask computed only where the grammar refuses the token; see
        rust/engine/masks.rs). ValueError on another value."""
    def add_request(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        grammar: Grammar | None = None,
        close_on_length: bool = False,
        reasoning_end: tuple[int, int] | None = None,
        closed_as_length: bool = False,
    ) -> list[int]:
        """Queue a request. ``seq_id`` in [0, 2**63), not in use. ``params``
        is read field by field (max_tokens, temperature, top_p, top_k, min_p,
        seed, presence/frequency/repetition penalties, stop_token_ids,
        ignore_eos, min_tokens, logit_bias, logprobs, fast_forward); any
        object with those attributes will do. top_k 0 disables top-k;
        temperature 0 is greedy; seed None draws a random seed. min_tokens:
        end/stop tokens are not sampled (and do not stop) before that many
        output tokens. logit_bias ({token: bias} or None) is added to the
        logits before temperature. Raises ValueError, changing nothing, on
        an empty prompt, a prompt that leaves no room to generate in
        ``max_model_len`` or needs more blocks than the pool, a duplicate
        id, or bad sampling parameters (TypeError on a field of the wrong
        type).

        With a ``grammar`` every sampled token is allowed by it (a hard mask),
        the grammar alone decides where the output may end (min_tokens does
        not hold end tokens back; once it is complete the sequence finishes
        with "stop"), and with ``fast_forward`` the tokens it forces are
        appended without sampling (computed by the next step as a prefill
        chunk). Returns the tokens forced at the very start, already part of
        the output (empty without a grammar or fast-forward). ``logprobs``
        (0-20): report each sampled token's log-probability with that many
        top alternatives (see ``sample``).

        With ``close_on_length`` an output that reaches its budget
        (max_tokens or the context) is steered to the shortest completion
        the grammar accepts, then an end token where one fits, and ends
        complete with finish_reason "stop" ("length" with
        ``closed_as_length``) and ``closed`` set on its last StepOutput; a
        request whose shortest complete output cannot fit in its budget
        raises ValueError saying how many tokens it needs. ``reasoning_end`` (end token, output length): from that length
        on, the end token replaces the sampled one where the grammar allows
        it (a reasoning block's budget; checked once, at that length)."""
    def schedule(self) -> StepPlan | None:
        """The next step's work, or None when there is nothing to run."""
    def speculating(self) -> bool:
        """Whether the plan in flight carries drafts (then only ``sample()``,
        on host logits, draws it)."""
    def set_step_cost(self, fixed: float, per_token: float) -> None:
        """What a step costs, fixed and per token fed (any unit): drafts are
        only as long as their rows are likely to pay for."""
    def start_masks(self) -> None:
        """Start computing the grammar masks of the last plan's sampling rows
        on Rust threads (rows in parallel, GIL released); ``sample()`` joins
        them. Call it before the forward pass so the two overlap; without it
        ``sample()`` computes them itself. RuntimeError before any plan."""
    def sample(
        self,
        logits: npt.NDArray[np.float32],
        allowed: npt.NDArray[np.int32] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32],
               list[tuple[float, list[tuple[int, float]]] | None]]:
        """Sample one token per sampling row of the last plan.

        ``logits`` is float32 [R, V] in ``sample_seq_ids`` order. ``allowed``
        is an optional int32 bitmask [R, W]: bit j of word i allows token
        32*i + j; tokens past the mask are disallowed; it is ANDed with the
        rows' grammar masks. Applies repetition,
        frequency and presence penalties, temperature, the mask, top-k, top-p,
        min-p, then draws from the request's own seeded RNG (rows in parallel,
        GIL released). Returns (tokens int64 [R], logprobs float32 [R], tops);
        the logprob is under the final filtered distribution (greedy: log-softmax
        of the penalised, masked logits). ``tops[r]`` is None unless the row's
        request asked for logprobs; then (the token's logprob, [(token,
        logprob)] most likely first), under the penalised, masked logits
        before temperature and filters. A row whose mask allows nothing gets
        token -1 and logprob -inf. Raises ValueError on a shape mismatch and
        RuntimeError before any plan."""
    def device_rows(self, vocab: int) -> DeviceRows:
        """The last plan's sampling rows as the device sampler's kernels read
        them (rust/cuda/device_sampling.rs), the grammar masks joined in (in place
        of ``sample``). Advances the random streams of the rows it hands
        over; rows marked ``host`` go to ``sample_host``."""
    def sample_host(self, logits: npt.NDArray[np.float32], rows: list[int]
                    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32],
                               list[tuple[float, list[tuple[int, float]]] | None]]:
        """After ``device_rows``: the CPU sampler over the plan's sampling
        rows ``rows``, whose logits [len(rows), V] are given in that order;
        returns as ``sample`` does."""
    def update(self, sampled: npt.NDArray[np.int64]) -> list[StepOutput]:
        """Append the sampled tokens ([R], ``sample`` order) and apply stop conditions.

        Returns one StepOutput per row (rows of sequences aborted since
        ``schedule()`` are left out). Finished sequences free their blocks
        (full blocks stay cached) and are forgotten."""
    def abort(self, seq_id: int) -> bool:
        """Remove a sequence from any queue and free its blocks; False if
        unknown. Nothing is reported for it."""
    def limit_prefix(self, seq_id: int, tokens: int) -> bool:
        """Let the request's prefix-cache hit be exactly its first ``tokens`` tokens or none
        (a model's recurrent state is known there alone: a snapshot); False if unknown."""
    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
    def num_cached_tokens(self, seq_id: int) -> int:
        """Prefix-cache hit tokens of a live request at its first admission (0
        before). Raises ValueError once it finished; use ``update()``'s value."""
    def stats(self) -> dict[str, int]:
        """prefix_cache_hit_tokens, prefix_cache_queries (prompt tokens looked
        up, counted again on re-admission after preemption),
        prefix_cache_state_miss_tokens (prompt tokens the KV cache held past a
        limit_prefix hit: recomputed for want of a state snapshot), preemptions,
        forced_tokens (appended by fast-forward), mask_time_us (wall time of
        the mask jobs), mask_wait_us (of it, what sample() waited for: the
        rest was hidden behind the forward pass; on demand, all of it was
        waited for), mask_rows (computed), mask_rows_on_demand (drawn without
        their mask and checked), mask_rows_refused (of those, refused, their
        mask then computed), num_running, num_waiting, num_free_blocks (free or evictable),
        num_cached_blocks, num_blocks."""
    def record_cache_events(self) -> None:
        """Record what enters and leaves the prefix cache from now on."""
    def take_cache_events(self) -> list[tuple[bool, int, int | None, list[int]]]:
        """The prefix cache's changes since the last call, oldest first: per
        full block stored ``(True, hash, parent hash or None, token ids)``,
        per block evicted ``(False, hash, None, [])``. Hashes are the cache's
        own (unsigned 64-bit, chained over the parent's)."""

@final
class GrammarCompiler:
    """Compiles llguidance grammars for one model's vocabulary.

    Built once per model: ``token_bytes[i]`` is what token i stands for
    (special tokens as ``b"\\xff" + text``, see ``guided.tokenizer.token_bytes``);
    ``end_token_ids`` is the model's whole end set (every one is allowed where
    the grammar may end); ``vocab_size`` may exceed ``len(token_bytes)`` (a
    padded embedding: the extra ids are never allowed). ``tokenize``, a
    ``str -> list[int]`` callable giving the canonical tokens of plain text,
    turns forced text into the tokens the model would see; without it greedy
    longest-match stands in. Raises ValueError on a bad vocabulary.
    """

    def __new__(
        cls,
        token_bytes: list[bytes],
        end_token_ids: list[int],
        vocab_size: int,
        cache_size: int = 128,
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> Self: ...
    @property
    def vocab_size(self) -> int: ...
    def compile(self, grammar_json: str) -> Grammar:
        """Compile a llguidance TopLevelGrammar (JSON text, e.g.
        ``{"grammars": [{"json_schema": {...}}]}`` or ``[{"lark_grammar": "..."}]``)
        or a bare Lark grammar. Results (failures too) are kept in an LRU
        cache keyed by the text. Raises ValueError with llguidance's message
        when the grammar is invalid or exceeds its limits; never crashes."""
    def cache_stats(self) -> dict[str, int]:
        """hits, misses, size, capacity."""

@final
class Grammar:
    """A compiled grammar; cheap to start matchers from."""

    def matcher(self) -> Matcher: ...

@final
class Matcher:
    """One walk through a grammar, token by token. After an error (a rejected
    token, a grammar limit) the mask is all zero and ``error()`` says why."""

    def compute_mask(self) -> npt.NDArray[np.int32]:
        """[ceil(vocab_size / 32)] bitmask: bit j of word i allows token 32*i + j.
        Where the grammar may end, every end token is allowed; once it is
        stopped, only the end tokens are."""
    def consume_token(self, token: int) -> bool:
        """Advance by one token; False if the grammar rejects it (the matcher
        is then in error)."""
    def consume_tokens(self, tokens: list[int]) -> bool: ...
    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (fast-forward), not consumed."""
    def is_accepting(self) -> bool:
        """Whether the grammar may end here."""
    def is_stopped(self) -> bool:
        """Whether it can go no further (complete, or failed)."""
    def error(self) -> str | None: ...
    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens."""
    def shortest_completion(self, max_tokens: int = 4096) -> list[int] | None:
        """The shortest completion found from here that the grammar accepts
        (empty where it accepts already), at most ``max_tokens`` tokens; None
        if none was found. Not consumed."""

@final
class QuantMatrix:
    """A weight matrix [rows, cols] given in a ggml block format (a GGUF
    tensor's bytes as stored). Where the format has a packing (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) it is repacked, eight rows
    interleaved, for the multi-row kernels (rust/cpu/packed.rs: activations
    quantized to 8 bits per 32 columns, each weight block loaded once for
    every row of a call); Q2_K and Q3_K keep ggml's rows and one-row dot
    products. Rows split over threads, the GIL released; a row's result never
    depends on the other rows of the call."""

    def __new__(cls, ggml_type: int, rows: int, cols: int, data: npt.NDArray[np.uint8]) -> Self:
        """``data``: rows × row-bytes, contiguous (copied, or repacked). ValueError
        names an unsupported type, columns that are not whole blocks, or a wrong length."""
    @staticmethod
    def quantize(ggml_type: int, dense: npt.NDArray[np.float32]) -> QuantMatrix:
        """A float32 [rows, cols] matrix in ``ggml_type``, by ggml's reference quantizer."""
    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    @property
    def format(self) -> str:
        """ggml's name of the block format, e.g. "Q4_1"."""
    @property
    def nbytes(self) -> int: ...
    def matmul(self, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32], precise: bool = False) -> None:
        """out[b, r] = Σ_c x[b, c] · W[r, c]; x [batch, cols], out [batch, rows],
        float32, C-contiguous. ``precise``: the activations' rounding error
        gets a second pass (about 16-bit activations)."""
    @property
    def packed(self) -> bool:
        """Whether the multi-row kernels run it (else ggml's one-row dot products)."""
    def dequantize(self, out: npt.NDArray[np.float32] | None = None) -> npt.NDArray[np.float32]:
        """The dense [rows, cols] matrix: ggml's dequantized values, into ``out`` if given."""
    def dequantize_rows(self, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
        """The rows ``ids`` dequantized, [len(ids), cols] (an embedding lookup); an id past the
        last row is a ValueError naming it."""

@final
class PackedFile:
    """A file of packed matrices (a load-cache entry, model/pack_cache.py), mapped
    read-only: its pages shared with the page cache, read in place."""
    def __new__(cls, path: str | os.PathLike[str]) -> Self:
        """OSError where the file cannot be opened or mapped."""
    @property
    def size(self) -> int: ...
    @staticmethod
    def write(path: str | os.PathLike[str], matrices: Sequence[QuantMatrix]) -> list[tuple[int, int]]:
        """Write the packed records of ``matrices`` to a new file at ``path`` (synced to the
        disk), each from a multiple of 64 bytes: (offset, nbytes) of each, for ``matrix``.
        ValueError names a matrix without a packing; OSError, a failed write."""
    def matrix(self, ggml_type: int, rows: int, cols: int, offset: int, nbytes: int) -> QuantMatrix:
        """The [rows, cols] matrix of format ``ggml_type`` whose packed records (a
        ``write``) are the file's ``nbytes`` from ``offset``, not
        copied. ValueError where they are not such a packing or not in the file."""

def packed_kernels() -> str:
    """The ISA the multi-row packed kernels run with here: "avx512_vnni", "avx2" (also
    where ``GUIDED_PACKED_ISA=avx2`` forces it) or "scalar"."""

def ggml_quantize(ggml_type: int, dense: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """A float32 [rows, cols] matrix as ggml rows of ``ggml_type`` (a GGUF tensor's bytes),
    by ggml's reference quantizer."""


@final
class NativeSpec:
    """The model's shape and its architecture's choices, as the native step reads them
    (keyword arguments only: a mistyped or missing one is a TypeError naming it; an unknown
    feature value a ValueError naming the field and the values it takes)."""
    def __new__(cls, *, hidden: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int, eps: float,
                norms: NormPlacement, norm_kind: NormKind, qk_norm: QkNorm | None, qk_norm_after_rope: bool,
                activation: Activation, swiglu_alpha: float, swiglu_limit: float, residual_multiplier: float,
                embedding_multiplier: float, logit_multiplier: float, final_softcap: float | None) -> Self: ...

@final
class NativeLinear:
    """A linear layer: its parts stacked by rows (QuantMatrix or float32 [rows, cols]) and a bias;
    ``precise``: a second pass over the activations' rounding error (the output head)."""
    def __new__(cls, *, parts: Sequence[QuantMatrix | _F32], bias: _F32 | None = None,
                precise: bool = False) -> Self: ...

@final
class NativeMlp:
    """A gated MLP or one expert: gate|up stacked, then down."""
    def __new__(cls, *, gate_up: NativeLinear, down: NativeLinear) -> Self: ...

@final
class NativeMoe:
    """A mixture of experts: the router, its routing (MoEConfig's fields), the experts."""
    def __new__(cls, *, router: NativeLinear, scoring: Scoring, top_k: int, norm_topk_prob: bool,
                routed_scaling: float, groups: int, topk_groups: int, experts: Sequence[NativeMlp],
                shared: NativeMlp | None = None, selection_bias: _F32 | None = None) -> Self: ...

@final
class NativeAttention:
    """Attention as a layer's mixer; ``rope``: the index of the rotary table it uses (None: no
    rotation); ``sinks``: a logit per head joining its softmax."""
    def __new__(cls, *, qkv: NativeLinear, o: NativeLinear, scale: float, window: int | None = None,
                softcap: float | None = None, sinks: _F32 | None = None, rope: int | None = None,
                q_norm: _F32 | None = None, k_norm: _F32 | None = None) -> Self: ...

@final
class NativeShortConv:
    """LFM2's gated short convolution as a layer's mixer; ``weight``: [hidden × kernel] taps, row-major."""
    def __new__(cls, *, in_proj: NativeLinear, out_proj: NativeLinear, weight: _F32,
                bias: _F32 | None = None) -> Self: ...

@final
class NativeLayer:
    """One layer: its mixer, its MLP, its norms."""
    def __new__(cls, *, mixer: NativeAttention | NativeShortConv, mlp: NativeMlp | NativeMoe,
                attn_norm: _F32 | None = None, mlp_norm: _F32 | None = None,
                attn_post_norm: _F32 | None = None, mlp_post_norm: _F32 | None = None) -> Self: ...

@final
class CpuDecoder:
    """A model's CPU step in native code (rust/cpu/native_step.rs; built by
    guided.model.native from a loaded model): every layer of every row of a
    step in one call, the GIL released."""

    def __new__(cls, spec: NativeSpec, embedding: _F32 | QuantMatrix, layers: Sequence[NativeLayer],
                norm: _F32, lm_head: NativeLinear,
                caches: list[tuple[_F32, _F32]]) -> Self:
        """``embedding``: the token table (read in place) or a QuantMatrix whose rows are
        dequantized on lookup; ``caches``: per layer (K, V), float32 [blocks, block_size,
        kv_heads, head_dim], written in place. ValueError names what does not fit."""
    def forward(self, plan: StepPlan, rope: list[npt.NDArray[np.float32]]) -> npt.NDArray[np.float32]:
        """The step's logits [rows that sample, vocab], its K/V written into the caches.
        ``rope``: each rotary table [positions, rotary_dim] (cos, then sin)."""
    def profile(self, on: bool) -> dict[str, float] | None:
        """``profile(True)`` times each phase of every step from then on; ``profile(False)``
        stops and returns the seconds per phase with "steps", "rows" and "total"."""

def quant_kernels() -> str | None:
    """The ISA level of ggml's kernels picked for this CPU at run time
    ("avx2", "avx512"), or None where none runs (then models load dense)."""

def quant_formats() -> list[tuple[str, int]]:
    """(name, ggml type id) of every weight format with a quantized kernel."""

def cpu_paged_attention(q: npt.NDArray[np.float32], k_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
                        v_cache: npt.NDArray[np.float32] | npt.NDArray[np.uint16],
                        block_tables: npt.NDArray[np.int32], seq: npt.NDArray[np.int32],
                        pos: npt.NDArray[np.int32], out: npt.NDArray[np.float32], scale: float,
                        window: int | None = None, softcap: float | None = None,
                        sinks: npt.NDArray[np.float32] | None = None, linger: bool = True) -> None:
    """out [rows, heads, head_size] = each query row's attention over positions
    0..=pos[r] of sequence seq[r] (its block table row), computed on its own
    (rust/cpu/cpu_attention.rs): the same bits in any batch. Caches [blocks,
    block_size, kv_heads, head_size], float32 or bfloat16 as uint16 bits;
    `window`: the last positions seen; `softcap`: tanh capping; `sinks`: one
    logit per head joining the softmax; `linger`: the kernel threads spin
    after the call for the next native kernel (False: they sleep, leaving the
    cores to torch's threads). Bad shapes or tables: ValueError."""

# -- the CUDA kernels (cuda/) and their CPU references ----------------------

def cuda_status() -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run here, else (False, why not)."""

def cuda_kernel_files() -> list[tuple[str, int]]:
    """(cuda/ file stem, fatbin bytes) of every embedded kernel file."""

def cuda_paged_decode(q: _TensorArg, k_cache: _TensorArg, v_cache: _TensorArg, block_tables: _TensorArg,
                      context_lens: _TensorArg, out: _TensorArg, scale: float, window: int, softcap: float,
                      sinks: _TensorArg | None, stream: int) -> None:
    """Decode attention over the paged KV cache, on ``stream``: the last
    ``window`` positions (0: all), scores soft-capped (0: not), per-head
    sink logits (float32 [heads]) in the softmax."""

def cuda_write_kv(k: _TensorArg, v: _TensorArg, k_cache: _TensorArg, v_cache: _TensorArg, slots: _TensorArg,
                  stream: int) -> None:
    """New K/V rows into their cache slots, on ``stream``."""

def check_sample_params(vocab: int, words: int | None, temperature: npt.NDArray[np.float32],
                        top_k: npt.NDArray[np.int32], top_p: npt.NDArray[np.float32],
                        min_p: npt.NDArray[np.float32]) -> None:
    """Raise ValueError naming the first bad size or row of a sampling call."""

def cuda_masked_sample(logits: _TensorArg, mask: _TensorArg | None, temperature: _TensorArg, top_k: _TensorArg,
                       top_p: _TensorArg, min_p: _TensorArg, seeds: _TensorArg, steps: _TensorArg,
                       tokens: _TensorArg, logprobs: _TensorArg, stream: int) -> None:
    """Mask-fused sampling, one token and its logprob per row, on ``stream``."""

def cuda_adjust_logits(logits: _TensorArg, rows: _TensorArg, tokens: _TensorArg, seen: _TensorArg,
                       counts: _TensorArg, bias: _TensorArg, repetition: _TensorArg, frequency: _TensorArg,
                       presence: _TensorArg, stream: int) -> None:
    """Penalties, logit bias and bans, in place, for (row, token) entries."""

def reference_paged_decode(q: npt.NDArray[np.float32], k_cache: npt.NDArray[np.float32],
                           v_cache: npt.NDArray[np.float32], block_tables: npt.NDArray[np.int32],
                           context_lens: npt.NDArray[np.int32], scale: float, window: int = 0,
                           softcap: float = 0.0, sinks: npt.NDArray[np.float32] | None = None
                           ) -> npt.NDArray[np.float32]:
    """The decode kernel's algorithm on the CPU."""

def reference_masked_sample(logits: npt.NDArray[np.float32], mask: npt.NDArray[np.int32] | None,
                            temperature: npt.NDArray[np.float32], top_k: npt.NDArray[np.int32],
                            top_p: npt.NDArray[np.float32], min_p: npt.NDArray[np.float32],
                            seeds: npt.NDArray[np.uint64], steps: npt.NDArray[np.uint64]
                            ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """The sampling kernel's algorithm on the CPU: (tokens, logprobs)."""

def reference_adjust_logits(logits: npt.NDArray[np.float32], rows: _Ints, tokens: _Ints, seen: _Ints,
                            counts: _Ints, bias: _F32, repetition: _F32, frequency: _F32,
                            presence: _F32) -> None:
    """The adjust kernel's algorithm on the CPU, in place on ``logits``
    [rows, vocab]; ValueError for an entry outside them."""
