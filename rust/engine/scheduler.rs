//! Continuous batching under a token budget: running sequences first (decodes
//! and unfinished prefill chunks), preemption by recompute when blocks run
//! out, then waiting sequences in FIFO order with a prefix-cache lookup.
//!
//! One engine step is `schedule()` → forward → `sample()` → `update()`.
//! `schedule()` counts the planned tokens as computed at once; the blocks they
//! fill enter the prefix cache only after the forward pass has written them,
//! that is at `update()` or, when a plan had no row to sample, at the next
//! `schedule()`. If a forward pass fails, abort the plan's sequences before
//! scheduling again.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;

use crate::engine::block_manager::{BlockManager, CacheEvent};
use crate::grammar::matchers::Grammar;
use crate::cuda::device_sampling::{device_rows, DeviceRows};
use crate::engine::masks::{row_masks, MaskBatch, MaskJob, MaskPolicy};
use crate::threads::pool;
use crate::sampling::random::Stream;
use crate::sampling::cpu_sampler::{sample_rows, Row, Sampled, SamplingParams};
use crate::engine::sequence::{token_ids, FinishReason, RequestParams, SeqId, Sequence, Status, Steering, Verified};
use crate::engine::speculative::{propose, walk, WalkedRows, Draft, Drafter, Drafts, Limits, Speculation};
pub use crate::engine::scheduler_counters::Counters;

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<i64>,
    pub enable_prefix_caching: bool,
    pub speculation: SpecConfig,
    /// Where constrained rows' masks are computed (masks.rs).
    pub masks: MaskPolicy,
}

/// Speculative decoding (speculative.rs): whether requests that do not say
/// speculate, the most tokens a step looks up for one sequence (0: never
/// speculate), and where drafts come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecConfig {
    pub by_default: bool,
    pub max_tokens: usize,
    pub drafter: Drafter,
}

/// `Invalid` is the caller's bad input (ValueError); `State` is a call out of
/// order (RuntimeError).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    Invalid(String),
    State(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Invalid(m) | Error::State(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Error {}

fn invalid<T>(msg: String) -> Result<T, Error> {
    Err(Error::Invalid(msg))
}

/// Flat arrays for one forward pass. `B` rows (sequences), `T` tokens,
/// `R` rows that sample; `block_tables` is `B × max_blocks`, row-major,
/// padded with 0.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    pub slot_mapping: Vec<i64>,
    pub block_tables: Vec<i32>,
    pub max_blocks: usize,
    pub context_lens: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub seq_ids: Vec<i64>,
    pub logits_indices: Vec<i64>,
    pub sample_seq_ids: Vec<i64>,
    pub max_query_len: usize,
    pub max_context_len: usize,
    pub is_decode_only: bool,
    pub num_tokens: usize,
}

/// One sampled row after `update()`: `token` is -1 when it was not appended
/// (the mask allowed nothing, or the grammar rejected it; then the reason is
/// Error). `forced` are the tokens the grammar forced after it, appended
/// without sampling; `error` says why a row failed; `closed` and
/// `closing_us`: see [`crate::engine::sequence::Verified`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOutput {
    pub seq_id: SeqId,
    pub token: i64,
    pub finish_reason: Option<FinishReason>,
    pub num_cached_tokens: usize,
    pub forced: Vec<u32>,
    /// With a draft (speculative.rs): the tokens later draws of the step
    /// appended after `forced`, `more_forced` of them forced.
    pub more: Vec<u32>,
    pub more_forced: usize,
    pub error: Option<String>,
    pub closed: bool,
    pub closing_us: u64,
}

/// One sequence's part of a step: its id, how many of its tokens, and the
/// draft fed after them.
type Chunk = (SeqId, usize, Draft);

/// The plan whose forward pass is (or was last) in flight.
#[derive(Debug, Default)]
struct InFlight {
    seq_ids: Vec<SeqId>,
    /// One per sampling row: a sequence with a draft has a row after each
    /// draft token too, in order.
    sample_ids: Vec<SeqId>,
    /// Per sampling sequence: its first row and its draft (empty without).
    spans: Vec<Span>,
}

#[derive(Debug)]
struct Span {
    id: SeqId,
    first: usize,
    draft: Draft,
}

impl InFlight {
    fn has_drafts(&self) -> bool {
        self.spans.iter().any(|s| !s.draft.is_empty())
    }
}

#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    eos: Vec<u32>,
    /// The longest a sequence may get: the context or the KV pool.
    max_len: usize,
    bm: BlockManager,
    seqs: HashMap<SeqId, Sequence>,
    waiting: VecDeque<SeqId>,
    /// In admission order: the last one is preempted first.
    running: Vec<SeqId>,
    in_flight: Option<InFlight>,
    /// The masks of the plan in flight, while they are computed.
    masks: Option<MaskJob>,
    /// The masks `device_rows()` joined, for `sample_host()`; dropped at `update()`.
    joined: Option<MaskBatch>,
    /// Per sequence that drew a draft's rows: the stream after each row
    /// drawn (None: not drawn), for `update()` to keep as far as it used.
    walks: HashMap<SeqId, Vec<Option<Stream>>>,
    /// How long drafts should be, from what they cost and keep.
    drafts: Drafts,
    counters: Counters,
    next_arrival: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, Error> {
        for (name, v) in [
            ("num_blocks", cfg.num_blocks),
            ("block_size", cfg.block_size),
            ("max_num_seqs", cfg.max_num_seqs),
            ("max_num_batched_tokens", cfg.max_num_batched_tokens),
        ] {
            if v == 0 {
                return invalid(format!("{name} must be at least 1"));
            }
        }
        if cfg.max_model_len < 2 {
            return invalid(format!("max_model_len must be at least 2, got {}", cfg.max_model_len));
        }
        if cfg.num_blocks > u32::MAX as usize / cfg.block_size {
            return invalid(format!("num_blocks × block_size must fit in 32 bits, got {} × {}", cfg.num_blocks, cfg.block_size));
        }
        let eos = token_ids("eos_token_ids", &cfg.eos_token_ids).map_err(Error::Invalid)?;
        Ok(Scheduler {
            eos,
            max_len: cfg.max_model_len.min(cfg.num_blocks * cfg.block_size),
            bm: BlockManager::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            in_flight: None,
            masks: None,
            joined: None,
            walks: HashMap::new(),
            drafts: Drafts::default(),
            counters: Counters::default(),
            next_arrival: 0,
            cfg,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queue a request; on error nothing changes. `seq_id` in [0, 2**63).
    pub fn add_request(&mut self, seq_id: i128, prompt: &[i64], req: &RequestParams) -> Result<(), Error> {
        self.add_constrained(seq_id, prompt, req, None, Steering::default()).map(|_| ())
    }

    /// Queue a request under a grammar (None: unconstrained). Returns the
    /// tokens the grammar forces at the start, already appended to the
    /// output when `req.fast_forward` is on. `steering` says how the output
    /// is steered beyond the mask: closed at its budget (see
    /// [`crate::grammar::closing`]; Err where it cannot fit), a reasoning block ended at its own.
    pub fn add_constrained(&mut self, seq_id: i128, prompt: &[i64], req: &RequestParams, grammar: Option<&Grammar>,
                           steering: Steering) -> Result<Vec<u32>, Error> {
        let Some(seq_id) = u64::try_from(seq_id).ok().filter(|&id| id <= i64::MAX as u64) else {
            return invalid(format!("seq_id must be in [0, 2**63), got {seq_id}"));
        };
        if self.seqs.contains_key(&seq_id) {
            return invalid(format!("seq_id {seq_id} is already in use"));
        }
        self.check_prompt_len(prompt.len())?;
        let tokens = token_ids("prompt token ids", prompt).map_err(Error::Invalid)?;
        let v = req.validate().map_err(Error::Invalid)?;
        let mut seq = Sequence::new(seq_id, tokens, v.sampling, v.stop, v.seed, self.next_arrival);
        // Rows asking for logprobs report one draw each: they do not speculate.
        let spec = self.cfg.speculation;
        if req.speculative.unwrap_or(spec.by_default) && spec.max_tokens > 0 && req.logprobs.is_none() {
            seq.speculation = Some(Speculation::default());
        }
        let constrain = |g| seq.constrain(g, req.fast_forward, steering, self.max_len).map_err(Error::Invalid);
        let forced = grammar.map(constrain).transpose()?.unwrap_or_default();
        self.counters.forced_tokens += forced.len();
        self.next_arrival += 1;
        self.seqs.insert(seq_id, seq);
        self.waiting.push_back(seq_id);
        Ok(forced)
    }

    fn check_prompt_len(&self, n: usize) -> Result<(), Error> {
        let ctx = self.cfg.max_model_len;
        if n == 0 {
            return invalid("the prompt is empty: give at least one token".into());
        }
        if n >= ctx {
            return invalid(format!(
                "prompt has {n} tokens; the context is {ctx} tokens and at least one must be generated"
            ));
        }
        if self.bm.blocks_for(n) > self.cfg.num_blocks {
            let pool = self.cfg.num_blocks * self.cfg.block_size;
            return invalid(format!(
                "prompt has {n} tokens; the KV cache holds only {pool} ({} blocks of {})",
                self.cfg.num_blocks, self.cfg.block_size
            ));
        }
        Ok(())
    }

    pub fn has_unfinished(&self) -> bool {
        !self.seqs.is_empty()
    }

    /// The prefix-cache hit of a live sequence at its first admission (0
    /// before it); `None` once it is finished or unknown.
    pub fn num_cached_tokens(&self, seq_id: SeqId) -> Option<usize> {
        self.seqs.get(&seq_id).map(|s| s.num_cached_tokens.unwrap_or(0))
    }

    pub fn sequence(&self, seq_id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&seq_id)
    }

    /// Record the prefix cache's changes from now on (see `take_cache_events`).
    pub fn record_cache_events(&mut self) {
        self.bm.record_events();
    }

    /// What entered and left the prefix cache since the last call.
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.bm.take_events()
    }

    pub fn counters(&self) -> Counters {
        self.counters
    }

    pub fn stats(&self) -> Vec<(&'static str, usize)> {
        let mut out = self.counters.entries();
        out.extend([
            ("num_running", self.running.len()),
            ("num_waiting", self.waiting.len()),
            ("num_free_blocks", self.bm.num_free_blocks()),
            ("num_cached_blocks", self.bm.num_cached_blocks()),
            ("num_blocks", self.bm.num_blocks()),
        ]);
        out
    }

    /// Let `seq_id`'s prefix-cache hit be exactly its first `tokens` tokens or nothing
    /// (a model whose state beyond the KV cache is known at that point alone: a snapshot of
    /// Mamba layers' states). False if the id is unknown.
    pub fn limit_prefix(&mut self, seq_id: SeqId, tokens: usize) -> bool {
        self.seqs.get_mut(&seq_id).map(|s| s.cache_limit = Some(tokens)).is_some()
    }

    /// Remove a sequence from whichever queue holds it and free its blocks;
    /// nothing is reported for it. False if the id is unknown.
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        if !self.seqs.contains_key(&seq_id) {
            return false;
        }
        self.forget(seq_id);
        true
    }

    fn forget(&mut self, seq_id: SeqId) {
        if let Some(mut seq) = self.seqs.remove(&seq_id) {
            self.bm.free(&mut seq.blocks);
            match seq.status {
                Status::Waiting => self.waiting.retain(|&id| id != seq_id),
                Status::Running => self.running.retain(|&id| id != seq_id),
                Status::Finished => {}
            }
        }
    }

    // ---- schedule -------------------------------------------------------

    /// The next step's work, or `None` when there is nothing to run.
    pub fn schedule(&mut self) -> Option<StepPlan> {
        self.join_masks(); // masks started for a plan that never sampled
        self.walks.clear();
        if let Some(flight) = self.in_flight.take() {
            self.drop_unsampled(&flight);
        }
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut chunks = Vec::new();
        let preempted = self.schedule_running(&mut budget, &mut chunks);
        // Admitting while preempting would only thrash.
        if !preempted {
            self.schedule_waiting(&mut budget, &mut chunks);
        }
        if chunks.is_empty() {
            return None;
        }
        Some(self.build_plan(&chunks))
    }

    /// Decodes and unfinished prefills, oldest first, each with its draft
    /// where it speculates; true if any sequence was preempted.
    fn schedule_running(&mut self, budget: &mut usize, chunks: &mut Vec<Chunk>) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let n = seq.num_uncomputed().min(*budget);
            let need = seq.num_computed_tokens + n;
            if n == 0 {
                i += 1;
                continue;
            }
            if !self.grow_or_preempt(id, need, &mut preempted) {
                break; // it preempted itself: it was the last one
            }
            let draft = self.draft_for(id, n, *budget - n);
            *budget -= n + draft.len();
            chunks.push((id, n, draft));
            i += 1;
        }
        preempted
    }

    /// The draft `id` carries into this step, where it speculates and its
    /// last token is in the step: at most `room` tokens, within its budget
    /// (a draft past max_tokens is never kept) and the free blocks (a draft
    /// never preempts anyone).
    fn draft_for(&mut self, id: SeqId, n: usize, room: usize) -> Draft {
        let (drafter, max_len) = (self.cfg.speculation.drafter, self.max_len);
        let threshold = self.drafts.threshold(self.running.len());
        let seq = self.seqs.get_mut(&id).expect("running sequence exists");
        if n != seq.num_uncomputed() {
            return Draft::default();
        }
        let room = room.min(seq.remaining(max_len).saturating_sub(1));
        let Some(spec) = seq.speculation.as_mut() else { return Draft::default() };
        let lookups = self.cfg.speculation.max_tokens;
        let limits = Limits { lookups, max_tokens: room.min(2 * lookups), threshold, probe: spec.probe_due() };
        let step = seq.rng.step.wrapping_add(seq.token_ids.len() as u64);
        let Sequence { token_ids, constraint, speculation, .. } = &mut *seq;
        let own = &speculation.as_ref().expect("checked above").own;
        let (matcher, ff) = match constraint.as_mut() {
            Some(c) => match c.matcher.as_mut() {
                Some(m) => (Some(m), c.fast_forward),
                None => return Draft::default(),
            },
            None => (None, false),
        };
        let draft = propose(drafter, token_ids, matcher, ff, limits, (self.drafts.rates(), own), step);
        if draft.is_empty() || !self.bm.grow(&mut seq.blocks, seq.token_ids.len() + draft.len()) {
            return Draft::default();
        }
        if draft.probe {
            if let Some(spec) = seq.speculation.as_mut() {
                spec.probed();
            }
        }
        draft
    }

    /// Make room for `id` to hold `need` tokens by preempting the newest
    /// running sequences; false if `id` itself had to go.
    fn grow_or_preempt(&mut self, id: SeqId, need: usize, preempted: &mut bool) -> bool {
        loop {
            let seq = self.seqs.get_mut(&id).expect("running sequence exists");
            if self.bm.grow(&mut seq.blocks, need) {
                return true;
            }
            let victim = *self.running.last().expect("the sequence itself is running");
            self.preempt(victim);
            *preempted = true;
            if victim == id {
                return false;
            }
        }
    }

    /// Free the newest running sequence's blocks and send it to the front of
    /// the queue; it recomputes everything so far (its full blocks stay
    /// cached, so it usually hits them again).
    fn preempt(&mut self, victim: SeqId) {
        let popped = self.running.pop();
        debug_assert_eq!(popped, Some(victim));
        let seq = self.seqs.get_mut(&victim).expect("running sequence exists");
        self.bm.free(&mut seq.blocks);
        seq.num_computed_tokens = 0;
        seq.status = Status::Waiting;
        self.waiting.push_front(victim);
        self.counters.preemptions += 1;
    }

    /// Admit waiting sequences in FIFO order. A sequence whose next
    /// uncached block is one a running sequence is still computing (the
    /// same prompt, or a shared prefix, admitted a moment before) waits:
    /// a step later it finds that block cached instead of computing it again.
    fn schedule_waiting(&mut self, budget: &mut usize, chunks: &mut Vec<Chunk>) {
        let bs = self.cfg.block_size;
        let mut computing = self.blocks_being_computed();
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            let prefix = match seq.cache_limit {
                Some(limit) => self.bm.lookup_exact(&seq.token_ids, limit),
                None => self.bm.lookup(&seq.token_ids),
            };
            let ahead = self.bm.hashes_from(&seq.token_ids, prefix.num_blocks(), prefix.last_hash());
            if ahead.first().is_some_and(|h| computing.contains(h)) {
                break; // FIFO: nobody overtakes the head of the queue
            }
            let hit = prefix.num_blocks() * bs;
            let n = (seq.len() - hit).min(*budget);
            if !self.bm.can_admit(&prefix, hit + n) {
                break;
            }
            computing.extend(ahead);
            self.waiting.pop_front();
            self.bm.take_prefix(&mut seq.blocks, prefix);
            let grown = self.bm.grow(&mut seq.blocks, hit + n);
            debug_assert!(grown, "can_admit promised room");
            if seq.num_cached_tokens.is_none() {
                // Prompt tokens only, at first admission: tokens the grammar
                // forced at the start are output, and a recompute after
                // preemption is not a prompt served from the cache.
                let cached = hit.min(seq.num_prompt_tokens);
                self.counters.prefix_cache_queries += seq.num_prompt_tokens;
                self.counters.prefix_cache_hit_tokens += cached;
                if seq.cache_limit.is_some() {
                    // what the KV cache held past the state's snapshot (a recurrent model's miss)
                    let held = self.bm.lookup(&seq.token_ids).num_blocks() * bs;
                    self.counters.prefix_cache_state_miss_tokens += held.min(seq.num_prompt_tokens) - cached;
                }
                seq.num_cached_tokens = Some(cached);
            }
            seq.num_computed_tokens = hit;
            seq.status = Status::Running;
            self.running.push(id);
            chunks.push((id, n, Draft::default()));
            *budget -= n;
        }
    }

    /// Hashes of the full blocks that running sequences have yet to compute
    /// (prompts still being prefilled).
    fn blocks_being_computed(&self) -> HashSet<u64> {
        let mut out = HashSet::new();
        for id in &self.running {
            let seq = &self.seqs[id];
            if seq.num_uncomputed() > 1 {
                let (from, parent) = seq.blocks.hashed();
                out.extend(self.bm.hashes_from(&seq.token_ids, from, parent));
            }
        }
        out
    }

    /// Lay the chunks out flat (a draft after its sequence's tokens) and
    /// count their real tokens as computed.
    fn build_plan(&mut self, chunks: &[Chunk]) -> StepPlan {
        let bs = self.cfg.block_size;
        let max_blocks = chunks.iter().map(|(id, _, _)| self.seqs[id].blocks.len()).max().unwrap_or(0);
        let mut plan = StepPlan { max_blocks, query_start_loc: vec![0], ..Default::default() };
        let mut flight = InFlight::default();
        for (id, n, draft) in chunks {
            let (id, n) = (*id, *n);
            let seq = self.seqs.get_mut(&id).expect("scheduled sequence exists");
            let start = seq.num_computed_tokens;
            let end = start + n;
            let fed = seq.token_ids[start..end].iter().chain(&draft.tokens);
            for (pos, &token) in (start..).zip(fed) {
                let block = seq.blocks.table[pos / bs] as usize;
                plan.input_ids.push(i64::from(token));
                plan.positions.push(pos as i64);
                plan.slot_mapping.push((block * bs + pos % bs) as i64);
            }
            let row = seq.blocks.table.iter().map(|&b| b as i32);
            plan.block_tables.extend(row.chain(std::iter::repeat(0)).take(max_blocks));
            plan.context_lens.push((end + draft.len()) as i32);
            plan.query_start_loc.push(plan.input_ids.len() as i32);
            plan.seq_ids.push(id as i64);
            if end == seq.len() {
                let first = flight.sample_ids.len();
                let last = plan.input_ids.len() as i64 - 1;
                for r in (0..=draft.len() as i64).rev() {
                    plan.logits_indices.push(last - r);
                    plan.sample_seq_ids.push(id as i64);
                    flight.sample_ids.push(id);
                }
                flight.spans.push(Span { id, first, draft: draft.clone() });
            }
            plan.max_query_len = plan.max_query_len.max(n + draft.len());
            plan.max_context_len = plan.max_context_len.max(end + draft.len());
            seq.num_computed_tokens = end;
            flight.seq_ids.push(id);
        }
        plan.num_tokens = plan.input_ids.len();
        plan.is_decode_only = plan.max_query_len == 1;
        self.in_flight = Some(flight);
        plan
    }

    /// A plan that never got its update(): its forward pass ran (a failed one
    /// aborts its sequences), but rows that should have sampled got no token,
    /// so their last token is fed again rather than leaving them stuck.
    fn drop_unsampled(&mut self, flight: &InFlight) {
        for id in &flight.sample_ids {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.num_computed_tokens = seq.num_computed_tokens.min(seq.len() - 1);
            }
        }
        self.commit(&flight.seq_ids);
    }

    /// Cache the full blocks the last forward pass wrote.
    fn commit(&mut self, ids: &[SeqId]) {
        for id in ids {
            if let Some(seq) = self.seqs.get_mut(id) {
                self.bm.commit(&mut seq.blocks, &seq.token_ids, seq.num_computed_tokens);
            }
        }
    }

    // ---- sample and update ---------------------------------------------

    /// Sample the last plan's rows. `logits` is `rows × vocab`; `mask`, if
    /// given, is `rows × words` (tokens past the mask are disallowed) and is
    /// ANDed with the rows' grammar masks (computed here if `start_masks()`
    /// was not called).
    pub fn sample(
        &mut self,
        logits: &[f32],
        rows: usize,
        vocab: usize,
        mask: Option<(&[i32], usize)>,
    ) -> Result<Vec<Sampled>, Error> {
        let n = self.sample_rows_count("sample")?;
        if rows != n || logits.len() != rows * vocab {
            return invalid(format!("logits has {rows} rows; the last plan samples {n} rows"));
        }
        if let Some((words, w)) = mask {
            if words.len() != rows * w {
                return invalid(format!("the mask has {} rows; the last plan samples {rows} rows", words.len() / w.max(1)));
            }
        }
        self.start_masks()?;
        let batch = self.join_masks();
        // Rows of sequences without a draft, all at once; those with one, walked.
        let flight = self.in_flight.as_ref().expect("checked above");
        let which: Vec<usize> = flight.spans.iter().filter(|s| s.draft.is_empty()).map(|s| s.first).collect();
        let owned_logits: Vec<f32>;
        let logits_in = if flight.has_drafts() {
            owned_logits = which.iter().flat_map(|&i| &logits[i * vocab..(i + 1) * vocab]).copied().collect();
            &owned_logits[..]
        } else {
            logits
        };
        let drawn = self.sample_on_host(logits_in, vocab, &which, batch.as_ref(), mask);
        let mut out = vec![Sampled { token: -1, logprob: f32::NEG_INFINITY, top: None }; rows];
        for (&i, s) in which.iter().zip(drawn) {
            out[i] = s;
        }
        self.walk_drafts(logits, vocab, batch.as_ref(), mask, &mut out);
        Ok(out)
    }

    /// Draw the rows of the sequences that carry a draft (speculative.rs):
    /// each walked on its own, sequences in parallel. Rows not drawn keep
    /// token -1 and are never read by `update()`.
    fn walk_drafts(&mut self, logits: &[f32], vocab: usize, batch: Option<&MaskBatch>, mask: Option<(&[i32], usize)>, out: &mut [Sampled]) {
        let Some(flight) = &self.in_flight else { return };
        let drafted: Vec<&Span> = flight.spans.iter().filter(|span| !span.draft.is_empty()).collect();
        if drafted.is_empty() {
            return;
        }
        let owned = row_masks(batch, mask, out.len());
        let masked = |i: usize| batch.is_some_and(|b| b.row(i).is_some()) || mask.is_some();
        let eos = &self.eos;
        // on the kernels' pool, as update() commits
        let mut walks: Vec<(&Span, Option<WalkedRows>)> = drafted.into_iter().map(|span| (span, None)).collect();
        pool::for_each_mut(&mut walks, &|(span, drawn)| {
            let Some(seq) = self.seqs.get(&span.id) else { return };
            let at = span.first..span.first + span.draft.len() + 1;
            let rows: Vec<&[f32]> = at.clone().map(|i| &logits[i * vocab..(i + 1) * vocab]).collect();
            let masks: Vec<Option<&[i32]>> = at.map(|i| masked(i).then_some(&owned[i][..])).collect();
            let row = Row { params: &seq.sampling, prompt: seq.prompt(), output: seq.output(), banned: &[] };
            *drawn = Some(walk(&span.draft, &rows, &masks, seq.constraint.is_some(), &row, |r| seq.banned_after(eos, r), seq.rng));
        });
        for (span, (draws, streams)) in walks.into_iter().filter_map(|(span, drawn)| Some((span, drawn?))) {
            let (id, first) = (span.id, span.first);
            for (r, s) in draws.into_iter().enumerate().filter_map(|(r, d)| Some((r, d?))) {
                out[first + r] = s;
            }
            self.walks.insert(id, streams);
        }
    }

    /// The last plan's rows as the device sampler reads them
    /// (`cuda/device_sampling.rs`), their grammar masks joined in. Rows marked
    /// `host` (they ask for top logprobs) are then drawn by `sample_host`.
    pub fn device_rows(&mut self, vocab: usize) -> Result<DeviceRows, Error> {
        let rows = self.sample_rows_count("device_rows")?;
        self.no_drafts("device_rows")?;
        self.start_masks()?;
        self.joined = self.join_masks();
        if let Some(mut b) = self.joined.take() {
            self.fill_deferred(&mut b);
            self.joined = Some(b);
        }
        let ids = self.in_flight.as_ref().map(|f| f.sample_ids.clone()).unwrap_or_default();
        let joined = self.joined.take();
        let masks: Vec<Option<&[i32]>> = (0..rows).map(|i| joined.as_ref().and_then(|b| b.row(i))).collect();
        let out = self.with_rows(&ids, |rows_in, rngs| device_rows(vocab, &masks, rows_in, rngs));
        self.joined = joined;
        Ok(out)
    }

    /// Draw rows `which` of the last plan on the host, after `device_rows`:
    /// `logits` holds those rows only (`which.len() × vocab`), masked by the
    /// grammar masks `device_rows` joined.
    pub fn sample_host(&mut self, logits: &[f32], which: &[usize], vocab: usize) -> Result<Vec<Sampled>, Error> {
        let rows = self.sample_rows_count("sample_host")?;
        self.no_drafts("sample_host")?;
        if let Some(&i) = which.iter().find(|&&i| i >= rows) {
            return invalid(format!("row {i} is not one of the last plan's {rows} sampling rows"));
        }
        if logits.len() != which.len() * vocab {
            return invalid(format!("logits has {} values; {} rows of {vocab} were named", logits.len(), which.len()));
        }
        let batch = self.joined.take();
        let out = self.sample_on_host(logits, vocab, which, batch.as_ref(), None);
        self.joined = batch;
        Ok(out)
    }

    /// What a forward pass costs: `fixed` plus `per_token` for each token
    /// fed (any unit, both the same). Drafts are then only as long as their
    /// rows are likely to pay for (speculative.rs).
    pub fn set_step_cost(&mut self, fixed: f32, per_token: f32) {
        self.drafts.set_step_cost(fixed, per_token);
    }

    /// Whether the plan in flight carries drafts: its rows are then drawn
    /// by `sample()` alone, walked as the drafts are checked.
    pub fn speculating(&self) -> bool {
        self.in_flight.as_ref().is_some_and(InFlight::has_drafts)
    }

    fn no_drafts(&self, what: &str) -> Result<(), Error> {
        if self.speculating() {
            return Err(Error::State(format!("{what}() cannot draw a plan that carries drafts: call sample() on the host logits")));
        }
        Ok(())
    }

    /// How many rows the plan in flight samples; a state error naming `what`
    /// without one.
    fn sample_rows_count(&self, what: &str) -> Result<usize, Error> {
        match &self.in_flight {
            Some(f) => Ok(f.sample_ids.len()),
            None => Err(Error::State(format!("{what}() called with no plan: call schedule() first"))),
        }
    }

    /// The CPU sampler over rows `which` of the plan in flight (`logits`
    /// holds those rows in that order); rows of sequences aborted since
    /// schedule() get token -1.
    fn sample_on_host(
        &mut self,
        logits: &[f32],
        vocab: usize,
        which: &[usize],
        batch: Option<&MaskBatch>,
        mask: Option<(&[i32], usize)>,
    ) -> Vec<Sampled> {
        let all = self.in_flight.as_ref().map(|f| f.sample_ids.clone()).unwrap_or_default();
        let ids: Vec<SeqId> = which.iter().map(|&i| all[i]).collect();
        let owned = row_masks(batch, mask, all.len());
        let masks: Vec<Option<&[i32]>> = which
            .iter()
            .map(|&i| (batch.is_some_and(|b| b.row(i).is_some()) || mask.is_some()).then_some(&owned[i][..]))
            .collect();
        // where rows were drawn without their mask, the streams they start from (for a redraw)
        let deferred = batch.filter(|b| which.iter().any(|&i| b.deferred[i]));
        let streams: Vec<Option<Stream>> = match deferred {
            Some(_) => ids.iter().map(|id| self.seqs.get(id).map(|s| s.rng)).collect(),
            None => Vec::new(),
        };
        let mut out = self.with_rows(&ids, |rows_in, rngs| sample_rows(logits, vocab, &masks, rows_in, rngs));
        if let Some(b) = deferred {
            self.redraw_refused(b, logits, vocab, which, &ids, &streams, mask, &mut out);
        }
        // rows of sequences aborted since schedule() drew from a stand-in
        for (id, o) in ids.iter().zip(&mut out) {
            if !self.seqs.contains_key(id) {
                o.token = -1;
            }
        }
        out
    }

    /// Run a sampler over the rows of sequences `ids` (what each samples
    /// from, and its random stream), then keep the streams as it advanced
    /// them. A sequence aborted since schedule() gets a stand-in row.
    fn with_rows<R>(&mut self, ids: &[SeqId], sampler: impl FnOnce(&[Row<'_>], &mut [Stream]) -> R) -> R {
        let stand_in = SamplingParams::default();
        let live: Vec<Option<&Sequence>> = ids.iter().map(|id| self.seqs.get(id)).collect();
        let banned: Vec<Vec<u32>> = live.iter().map(|s| s.map_or(Vec::new(), |s| s.banned_tokens(&self.eos))).collect();
        let rows: Vec<Row<'_>> = live
            .iter()
            .zip(&banned)
            .map(|(s, banned)| match s {
                Some(s) => Row { params: &s.sampling, prompt: s.prompt(), output: s.output(), banned },
                None => Row { params: &stand_in, prompt: &[], output: &[], banned },
            })
            .collect();
        let mut rngs: Vec<Stream> = live.iter().map(|s| s.map_or(Stream::new(Some(0)), |s| s.rng)).collect();
        let out = sampler(&rows, &mut rngs);
        for (id, rng) in ids.iter().zip(rngs) {
            if let Some(seq) = self.seqs.get_mut(id) {
                seq.rng = rng;
            }
        }
        out
    }

    /// Append one sampled token per row of the last plan, apply stop
    /// conditions and free finished sequences. Rows of sequences aborted
    /// since schedule() are skipped.
    pub fn update(&mut self, sampled: &[i64]) -> Result<Vec<StepOutput>, Error> {
        let Some(flight) = self.in_flight.take() else {
            if sampled.is_empty() {
                return Ok(Vec::new());
            }
            return Err(Error::State("update() called with no plan: call schedule() first".into()));
        };
        if sampled.len() != flight.sample_ids.len() {
            let n = flight.sample_ids.len();
            self.in_flight = Some(flight);
            return invalid(format!("update() got {} tokens; the last plan samples {n} rows", sampled.len()));
        }
        self.join_masks(); // started, but sampled elsewhere
        self.joined = None;
        self.commit(&flight.seq_ids);
        let walks = std::mem::take(&mut self.walks);
        // Each sequence advances its own grammar (and may search for a
        // closing, crate::grammar::closing): in parallel, on the kernels' pool,
        // whose threads still spin from the forward pass (rayon's would have to
        // wake beside them, and then spin on cores the next step needs).
        let span_of: HashMap<SeqId, usize> = flight.spans.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        let mut rows: Vec<(usize, &mut Sequence, Option<(Verified, usize)>)> =
            self.seqs.iter_mut().filter_map(|(id, s)| span_of.get(id).map(|&i| (i, s, None))).collect();
        rows.sort_unstable_by_key(|(i, _, _)| *i);
        let (eos, max_len, spans) = (&self.eos, self.max_len, &flight.spans);
        pool::for_each_mut(&mut rows, &|(i, seq, done)| {
            let span = &spans[*i];
            let mut v = match walks.get(&span.id) {
                Some(streams) => {
                    let draws = &sampled[span.first..span.first + span.draft.len() + 1];
                    seq.commit_drafted(&span.draft, draws, streams, eos, max_len)
                }
                None => seq.commit(sampled[span.first], eos, max_len).into(),
            };
            v.closing_us = if v.reason.is_some() { seq.closing_us() } else { 0 };
            *done = Some((v, seq.num_cached_tokens.unwrap_or(0)));
        });
        let commits: Vec<(usize, Verified, usize)> =
            rows.into_iter().map(|(i, _, done)| done.map(|(v, n)| (i, v, n)).expect("every row committed")).collect();
        // The draft tokens kept are computed: into the cache before a finished one goes.
        let drafted: Vec<SeqId> = spans.iter().filter(|s| !s.draft.is_empty()).map(|s| s.id).collect();
        self.commit(&drafted);
        let mut out = Vec::with_capacity(commits.len());
        for (i, v, num_cached_tokens) in commits {
            let span = &flight.spans[i];
            let (id, token, c) = (span.id, sampled[span.first], &v.first);
            self.counters.forced_tokens += c.forced.len() + v.more_forced;
            if !span.draft.is_empty() {
                let appended = usize::from(c.appended) + c.forced.len() + v.more.len();
                let own = self.seqs.get_mut(&id).and_then(|s| s.speculation.as_mut());
                self.drafts.record(&mut self.counters.drafts, &span.draft, v.kept, v.reason.is_some(), appended, own);
            }
            out.push(StepOutput {
                seq_id: id,
                token: if c.appended { c.replaced_by.map_or(token, i64::from) } else { -1 },
                finish_reason: v.reason,
                num_cached_tokens,
                forced: v.first.forced,
                more: v.more,
                more_forced: v.more_forced,
                error: v.error,
                closed: v.closed,
                closing_us: v.closing_us,
            });
            if v.reason.is_some() {
                self.forget(id);
            }
        }
        Ok(out)
    }
}

#[path = "scheduler_masks.rs"]
mod grammar_masks;

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
