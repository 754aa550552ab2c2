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
use std::time::Instant;

use crate::block_manager::{BlockManager, CacheEvent};
use crate::grammar::Grammar;
use crate::masks::{MaskBatch, MaskJob, MaskRow};
use crate::sampling::{sample_rows, Row, Sampled, SamplingParams};
use crate::sequence::{token_ids, FinishReason, RequestParams, SeqId, Sequence, Status, Steering};

#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub eos_token_ids: Vec<i64>,
    pub enable_prefix_caching: bool,
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
/// without sampling; `error` says why a row failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepOutput {
    pub seq_id: SeqId,
    pub token: i64,
    pub finish_reason: Option<FinishReason>,
    pub num_cached_tokens: usize,
    pub forced: Vec<u32>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub prefix_cache_hit_tokens: usize,
    pub prefix_cache_queries: usize,
    pub preemptions: usize,
    /// Tokens appended by fast-forward, without sampling.
    pub forced_tokens: usize,
    /// Wall time of the mask jobs, and how much of it sample() waited for:
    /// the difference was hidden behind the forward pass.
    pub mask_time_us: u64,
    pub mask_wait_us: u64,
    /// Row masks computed.
    pub mask_rows: usize,
}

/// The plan whose forward pass is (or was last) in flight.
#[derive(Debug, Default)]
struct InFlight {
    seq_ids: Vec<SeqId>,
    sample_ids: Vec<SeqId>,
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
            counters: Counters::default(),
            next_arrival: 0,
            cfg,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Queue a request; on error nothing changes.
    /// `seq_id` must be in [0, 2**63) (plans carry ids as int64).
    pub fn add_request(&mut self, seq_id: i128, prompt: &[i64], req: &RequestParams) -> Result<(), Error> {
        self.add_constrained(seq_id, prompt, req, None, Steering::default()).map(|_| ())
    }

    /// Queue a request under a grammar (None: unconstrained). Returns the
    /// tokens the grammar forces at the start, already appended to the
    /// output when `req.fast_forward` is on. `steering` says how the output
    /// is steered beyond the mask: closed at its budget (see
    /// [`crate::closing`]), a reasoning block ended at its own.
    pub fn add_constrained(
        &mut self,
        seq_id: i128,
        prompt: &[i64],
        req: &RequestParams,
        grammar: Option<&Grammar>,
        steering: Steering,
    ) -> Result<Vec<u32>, Error> {
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
        let forced = match grammar {
            Some(g) => seq.constrain(g.matcher(), req.fast_forward, steering, self.max_len),
            None => Vec::new(),
        };
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
        vec![
            ("prefix_cache_hit_tokens", self.counters.prefix_cache_hit_tokens),
            ("prefix_cache_queries", self.counters.prefix_cache_queries),
            ("preemptions", self.counters.preemptions),
            ("forced_tokens", self.counters.forced_tokens),
            ("mask_time_us", self.counters.mask_time_us as usize),
            ("mask_wait_us", self.counters.mask_wait_us as usize),
            ("mask_rows", self.counters.mask_rows),
            ("num_running", self.running.len()),
            ("num_waiting", self.waiting.len()),
            ("num_free_blocks", self.bm.num_free_blocks()),
            ("num_cached_blocks", self.bm.num_cached_blocks()),
            ("num_blocks", self.bm.num_blocks()),
        ]
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

    /// Decodes and unfinished prefills, oldest first; true if any sequence
    /// was preempted.
    fn schedule_running(&mut self, budget: &mut usize, chunks: &mut Vec<(SeqId, usize)>) -> bool {
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
            chunks.push((id, n));
            *budget -= n;
            i += 1;
        }
        preempted
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
    fn schedule_waiting(&mut self, budget: &mut usize, chunks: &mut Vec<(SeqId, usize)>) {
        let bs = self.cfg.block_size;
        let mut computing = self.blocks_being_computed();
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            let prefix = self.bm.lookup(&seq.token_ids);
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
                seq.num_cached_tokens = Some(cached);
            }
            seq.num_computed_tokens = hit;
            seq.status = Status::Running;
            self.running.push(id);
            chunks.push((id, n));
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

    /// Lay the chunks out flat and count them as computed.
    fn build_plan(&mut self, chunks: &[(SeqId, usize)]) -> StepPlan {
        let bs = self.cfg.block_size;
        let max_blocks = chunks.iter().map(|(id, _)| self.seqs[id].blocks.len()).max().unwrap_or(0);
        let mut plan = StepPlan { max_blocks, query_start_loc: vec![0], ..Default::default() };
        let mut flight = InFlight::default();
        for &(id, n) in chunks {
            let seq = self.seqs.get_mut(&id).expect("scheduled sequence exists");
            let start = seq.num_computed_tokens;
            let end = start + n;
            for pos in start..end {
                let block = seq.blocks.table[pos / bs] as usize;
                plan.input_ids.push(i64::from(seq.token_ids[pos]));
                plan.positions.push(pos as i64);
                plan.slot_mapping.push((block * bs + pos % bs) as i64);
            }
            let row = seq.blocks.table.iter().map(|&b| b as i32);
            plan.block_tables.extend(row.chain(std::iter::repeat(0)).take(max_blocks));
            plan.context_lens.push(end as i32);
            plan.query_start_loc.push(plan.input_ids.len() as i32);
            plan.seq_ids.push(id as i64);
            if end == seq.len() {
                plan.logits_indices.push(plan.input_ids.len() as i64 - 1);
                plan.sample_seq_ids.push(id as i64);
                flight.sample_ids.push(id);
            }
            plan.max_query_len = plan.max_query_len.max(n);
            plan.max_context_len = plan.max_context_len.max(end);
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

    // ---- grammar masks ---------------------------------------------------

    /// Start computing the grammar masks of the last plan's sampling rows on
    /// a background thread; `sample()` joins it. Call it right after
    /// `schedule()`, before the forward pass, so the two overlap. A no-op
    /// when no row has a grammar or the job is already started.
    pub fn start_masks(&mut self) -> Result<(), Error> {
        let Some(flight) = &self.in_flight else {
            return Err(Error::State("start_masks() called with no plan: call schedule() first".into()));
        };
        if self.masks.is_some() {
            return Ok(());
        }
        let rows: Vec<MaskRow> = flight
            .sample_ids
            .iter()
            .map(|id| {
                let c = self.seqs.get_mut(id)?.constraint.as_mut()?;
                Some((*id, c.matcher.take()?, None))
            })
            .collect();
        if rows.iter().any(Option::is_some) {
            self.masks = Some(MaskJob::spawn(rows));
        }
        Ok(())
    }

    /// Wait for the mask job, if any, and give the matchers back to their
    /// sequences (those aborted meanwhile are dropped).
    fn join_masks(&mut self) -> Option<MaskBatch> {
        let job = self.masks.take()?;
        let t0 = Instant::now();
        let batch = job.join();
        self.counters.mask_wait_us += t0.elapsed().as_micros() as u64;
        let mut batch = batch?;
        self.counters.mask_time_us += batch.elapsed_us;
        for (id, m, err) in std::mem::take(&mut batch.rows).into_iter().flatten() {
            self.counters.mask_rows += 1;
            if let Some(c) = self.seqs.get_mut(&id).and_then(|s| s.constraint.as_mut()) {
                c.mask_error = err;
                c.matcher = Some(m);
            }
        }
        Some(batch)
    }

    /// Each row's mask: the grammar's, the caller's, or both ANDed (words
    /// past the shorter one are disallowed).
    fn row_masks<'a>(
        batch: Option<&'a MaskBatch>,
        external: Option<(&'a [i32], usize)>,
        rows: usize,
    ) -> Vec<std::borrow::Cow<'a, [i32]>> {
        use std::borrow::Cow;
        let ext = |i: usize| external.map(|(w, n)| &w[i * n..(i + 1) * n]);
        (0..rows)
            .map(|i| match (batch.and_then(|b| b.row(i)), ext(i)) {
                (Some(g), None) => Cow::Borrowed(g),
                (None, Some(e)) => Cow::Borrowed(e),
                (Some(g), Some(e)) => Cow::Owned(g.iter().zip(e).map(|(a, b)| a & b).collect()),
                (None, None) => Cow::Borrowed(&[][..]),
            })
            .collect()
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
        let ids = match &self.in_flight {
            Some(f) => f.sample_ids.clone(),
            None => return Err(Error::State("sample() called with no plan: call schedule() first".into())),
        };
        if rows != ids.len() || logits.len() != rows * vocab {
            return invalid(format!("logits has {rows} rows; the last plan samples {} rows", ids.len()));
        }
        if let Some((words, w)) = mask {
            if words.len() != rows * w {
                return invalid(format!("the mask has {} rows; the last plan samples {rows} rows", words.len() / w.max(1)));
            }
        }
        self.start_masks()?;
        let batch = self.join_masks();
        let constrained: Vec<bool> = (0..rows).map(|i| batch.as_ref().is_some_and(|b| b.row(i).is_some()) || mask.is_some()).collect();
        let owned = Self::row_masks(batch.as_ref(), mask, rows);
        let masks: Vec<Option<&[i32]>> = owned.iter().zip(&constrained).map(|(m, &c)| c.then_some(&m[..])).collect();
        // Rows of sequences aborted since schedule() get a stand-in and -1.
        let stand_in = SamplingParams::default();
        let live: Vec<Option<&Sequence>> = ids.iter().map(|id| self.seqs.get(id)).collect();
        let banned: Vec<Vec<u32>> = live.iter().map(|s| s.map_or(Vec::new(), |s| s.banned_tokens(&self.eos))).collect();
        let rows_in: Vec<Row<'_>> = live
            .iter()
            .zip(&banned)
            .map(|(s, banned)| match s {
                Some(s) => Row { params: &s.sampling, prompt: s.prompt(), output: s.output(), banned },
                None => Row { params: &stand_in, prompt: &[], output: &[], banned },
            })
            .collect();
        let mut rngs: Vec<_> = live.iter().map(|s| s.map_or_else(|| crate::sampling::new_rng(Some(0)), |s| s.rng.clone())).collect();
        let mut out = sample_rows(logits, vocab, &masks, &rows_in, &mut rngs);
        for ((id, rng), o) in ids.iter().zip(rngs).zip(&mut out) {
            match self.seqs.get_mut(id) {
                Some(seq) => seq.rng = rng,
                None => o.token = -1,
            }
        }
        Ok(out)
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
        self.commit(&flight.seq_ids);
        let mut out = Vec::with_capacity(sampled.len());
        for (&id, &token) in flight.sample_ids.iter().zip(sampled) {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            let c = seq.commit(token, &self.eos, self.max_len);
            self.counters.forced_tokens += c.forced.len();
            out.push(StepOutput {
                seq_id: id,
                token: if c.appended { c.replaced_by.map_or(token, i64::from) } else { -1 },
                finish_reason: c.reason,
                num_cached_tokens: seq.num_cached_tokens.unwrap_or(0),
                forced: c.forced,
                error: c.error,
            });
            if c.reason.is_some() {
                self.forget(id);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(num_blocks: usize, block_size: usize) -> SchedulerConfig {
        SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            max_model_len: 256,
            eos_token_ids: vec![0],
            enable_prefix_caching: true,
        }
    }

    fn req(max_tokens: i64) -> RequestParams {
        RequestParams { max_tokens, ..Default::default() }
    }

    fn prompt(n: usize, salt: i64) -> Vec<i64> {
        (0..n as i64).map(|i| 1 + (i * 7 + salt) % 50).collect()
    }

    /// Run steps, answering every sampled row with `token`, until idle.
    fn drain(s: &mut Scheduler, token: i64) -> Vec<StepOutput> {
        let mut finished = Vec::new();
        for _ in 0..10_000 {
            let Some(plan) = s.schedule() else { break };
            let out = s.update(&vec![token; plan.sample_seq_ids.len()]).unwrap();
            finished.extend(out.into_iter().filter(|o| o.finish_reason.is_some()));
        }
        assert!(!s.has_unfinished());
        finished
    }

    #[test]
    fn prefill_then_decode() {
        let mut s = Scheduler::new(cfg(16, 16)).unwrap();
        s.add_request(7, &prompt(40, 0), &req(3)).unwrap();
        let plan = s.schedule().unwrap();
        assert_eq!(plan.num_tokens, 40);
        assert_eq!(plan.positions, (0..40).collect::<Vec<i64>>());
        assert_eq!(plan.max_blocks, 3);
        assert_eq!(plan.block_tables, vec![0, 1, 2]);
        assert_eq!(plan.slot_mapping[17], 17);
        assert_eq!(plan.context_lens, vec![40]);
        assert_eq!(plan.query_start_loc, vec![0, 40]);
        assert_eq!(plan.logits_indices, vec![39]);
        assert_eq!(plan.sample_seq_ids, vec![7]);
        assert!(!plan.is_decode_only);
        let out = s.update(&[5]).unwrap();
        assert_eq!(out, vec![StepOutput { seq_id: 7, token: 5, finish_reason: None, num_cached_tokens: 0, forced: vec![], error: None }]);
        let plan = s.schedule().unwrap();
        assert_eq!((plan.input_ids.clone(), plan.positions.clone()), (vec![5], vec![40]));
        assert_eq!(plan.context_lens, vec![41]);
        assert!(plan.is_decode_only);
        s.update(&[6]).unwrap();
        s.schedule().unwrap();
        let out = s.update(&[8]).unwrap();
        assert_eq!(out[0].finish_reason, Some(FinishReason::Length));
        assert!(!s.has_unfinished());
        assert!(s.schedule().is_none());
        assert_eq!(s.bm.num_free_blocks(), 16);
    }

    #[test]
    fn a_prompt_being_computed_is_not_computed_twice() {
        let mut s = Scheduler::new(cfg(32, 16)).unwrap();
        let shared = prompt(40, 0);
        s.add_request(1, &shared, &req(2)).unwrap();
        s.add_request(2, &shared, &req(2)).unwrap();
        let mut other = prompt(40, 3);
        other[0] = 49; // no block in common with `shared`
        s.add_request(3, &other, &req(2)).unwrap();
        // The second copy waits one step (and, FIFO, so does the one behind it)...
        let plan = s.schedule().unwrap();
        assert_eq!(plan.seq_ids, vec![1]);
        s.update(&[5]).unwrap();
        // ...and then finds the first one's two full blocks cached.
        let plan = s.schedule().unwrap();
        assert_eq!(plan.seq_ids, vec![1, 2, 3]);
        assert_eq!(plan.query_start_loc, vec![0, 1, 9, 49]);
        let out = s.update(&[5, 5, 5]).unwrap();
        assert_eq!(out[1].num_cached_tokens, 32);
        assert_eq!(out[2].num_cached_tokens, 0);
        drain(&mut s, 5);
    }

    #[test]
    fn prompts_with_nothing_in_common_start_together() {
        let mut s = Scheduler::new(cfg(32, 16)).unwrap();
        s.add_request(1, &prompt(20, 0), &req(2)).unwrap();
        s.add_request(2, &prompt(20, 1), &req(2)).unwrap();
        // a prompt shorter than a block shares no full block with anything
        s.add_request(3, &prompt(10, 0), &req(2)).unwrap();
        assert_eq!(s.schedule().unwrap().seq_ids, vec![1, 2, 3]);
    }

    #[test]
    fn long_prompts_are_chunked() {
        let mut c = cfg(16, 16);
        c.max_num_batched_tokens = 16;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(1, &prompt(40, 0), &req(2)).unwrap();
        let mut sizes = Vec::new();
        for _ in 0..3 {
            let plan = s.schedule().unwrap();
            sizes.push((plan.num_tokens, plan.logits_indices.len(), plan.positions[0]));
            // Partial chunks sample nothing; update is still fine to call.
            s.update(&vec![3; plan.logits_indices.len()]).unwrap();
        }
        assert_eq!(sizes, vec![(16, 0, 0), (16, 0, 16), (8, 1, 32)]);
    }

    #[test]
    fn decodes_go_before_new_prefills_and_budget_holds() {
        let mut c = cfg(64, 16);
        c.max_num_batched_tokens = 20;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(1, &prompt(10, 0), &req(5)).unwrap();
        s.schedule().unwrap();
        s.update(&[3]).unwrap();
        s.add_request(2, &prompt(30, 1), &req(5)).unwrap();
        let plan = s.schedule().unwrap();
        assert_eq!(plan.seq_ids, vec![1, 2]);
        assert_eq!(plan.query_start_loc, vec![0, 1, 20]);
        assert_eq!(plan.sample_seq_ids, vec![1]);
        assert_eq!(plan.logits_indices, vec![0]);
    }

    #[test]
    fn max_num_seqs_caps_the_batch() {
        let mut c = cfg(64, 4);
        c.max_num_seqs = 2;
        let mut s = Scheduler::new(c).unwrap();
        for id in 0..3 {
            s.add_request(id, &prompt(5, id as i64), &req(4)).unwrap();
        }
        let plan = s.schedule().unwrap();
        assert_eq!(plan.seq_ids, vec![0, 1]);
        s.update(&[3, 3]).unwrap();
        assert_eq!(drain(&mut s, 3).len(), 3);
    }

    #[test]
    fn a_plan_left_without_update_is_fed_again() {
        let mut s = Scheduler::new(cfg(8, 4)).unwrap();
        s.add_request(1, &prompt(5, 0), &req(2)).unwrap();
        s.schedule().unwrap();
        let plan = s.schedule().unwrap();
        assert_eq!((plan.positions.clone(), plan.context_lens.clone()), (vec![4], vec![5]));
        assert_eq!(drain(&mut s, 3).len(), 1);
    }

    #[test]
    fn prefix_cache_hits_leave_one_token() {
        let mut s = Scheduler::new(cfg(16, 16)).unwrap();
        let p = prompt(40, 0);
        s.add_request(1, &p, &req(1)).unwrap();
        drain(&mut s, 3);
        s.add_request(2, &p, &req(1)).unwrap();
        let plan = s.schedule().unwrap();
        assert_eq!(plan.num_tokens, 8);
        assert_eq!(plan.positions[0], 32);
        assert_eq!(plan.block_tables[..2], [0, 1]);
        let out = s.update(&[3]).unwrap();
        assert_eq!(out[0].num_cached_tokens, 32);
        let stats: HashMap<_, _> = s.stats().into_iter().collect();
        assert_eq!(stats["prefix_cache_hit_tokens"], 32);
        assert_eq!(stats["prefix_cache_queries"], 80);
        // A prompt of exactly two blocks hits only the first.
        s.add_request(3, &p[..32], &req(1)).unwrap();
        assert_eq!(s.schedule().unwrap().num_tokens, 16);
    }

    #[test]
    fn chunked_prefill_blocks_are_cached_without_sampling() {
        let mut c = cfg(16, 4);
        c.max_num_batched_tokens = 8;
        let mut s = Scheduler::new(c).unwrap();
        let p = prompt(20, 0);
        s.add_request(1, &p, &req(4)).unwrap();
        let plan = s.schedule().unwrap();
        assert!(plan.logits_indices.is_empty());
        // No update: the next schedule commits the blocks just written.
        s.schedule().unwrap();
        s.add_request(2, &p[..9], &req(4)).unwrap();
        s.update(&[]).unwrap();
        let plan = s.schedule().unwrap();
        assert_eq!(plan.seq_ids, vec![1, 2]);
        assert_eq!(s.num_cached_tokens(2), Some(8));
    }

    #[test]
    fn preemption_recomputes_newest_and_everything_finishes() {
        let mut c = cfg(6, 4);
        c.max_model_len = 64;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(1, &prompt(7, 0), &req(8)).unwrap();
        s.add_request(2, &prompt(7, 1), &req(8)).unwrap();
        let mut saw_preemption = false;
        for _ in 0..100 {
            let Some(plan) = s.schedule() else { break };
            saw_preemption |= s.counters().preemptions > 0;
            s.update(&vec![3; plan.sample_seq_ids.len()]).unwrap();
        }
        assert!(saw_preemption);
        assert!(!s.has_unfinished());
        assert_eq!(s.bm.num_free_blocks(), 6);
    }

    #[test]
    fn stop_conditions() {
        let mut s = Scheduler::new(cfg(64, 4)).unwrap();
        s.add_request(1, &prompt(5, 0), &req(10)).unwrap();
        s.add_request(2, &prompt(5, 1), &RequestParams { stop_token_ids: vec![9], ..req(10) }).unwrap();
        s.add_request(3, &prompt(5, 2), &RequestParams { min_tokens: 2, ..req(10) }).unwrap();
        s.add_request(4, &prompt(5, 3), &RequestParams { ignore_eos: true, ..req(10) }).unwrap();
        s.schedule().unwrap();
        let out = s.update(&[0, 9, 0, 0]).unwrap();
        let reasons: Vec<_> = out.iter().map(|o| o.finish_reason).collect();
        assert_eq!(reasons, vec![Some(FinishReason::Stop), Some(FinishReason::Stop), None, None]);
        s.schedule().unwrap();
        let out = s.update(&[5, -1]).unwrap();
        assert_eq!(out[0].finish_reason, None);
        assert_eq!(out[1].finish_reason, Some(FinishReason::Error));
        s.schedule().unwrap();
        assert_eq!(s.update(&[0]).unwrap()[0].finish_reason, Some(FinishReason::Stop));
    }

    #[test]
    fn length_at_the_context_or_pool_end() {
        let mut c = cfg(2, 4);
        c.max_model_len = 100;
        let mut s = Scheduler::new(c).unwrap();
        s.add_request(1, &prompt(6, 0), &req(50)).unwrap();
        let done = drain(&mut s, 3);
        assert_eq!(done[0].finish_reason, Some(FinishReason::Length));
        assert_eq!(s.counters().preemptions, 0);
    }

    #[test]
    fn abort_frees_and_forgets() {
        let mut s = Scheduler::new(cfg(8, 4)).unwrap();
        s.add_request(1, &prompt(9, 0), &req(10)).unwrap();
        s.add_request(2, &prompt(9, 1), &req(10)).unwrap();
        s.schedule().unwrap();
        assert!(s.abort(1));
        assert!(!s.abort(1));
        // The aborted row is skipped; the other goes on.
        let out = s.update(&[3, 4]).unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].seq_id, 2);
        assert!(s.abort(2));
        assert!(!s.has_unfinished());
        assert_eq!(s.bm.num_free_blocks(), 8);
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut s = Scheduler::new(cfg(4, 4)).unwrap();
        let cases: Vec<(Vec<i64>, RequestParams, &str)> = vec![
            (vec![], req(1), "empty"),
            (prompt(256, 0), req(1), "at least one must be generated"),
            (prompt(17, 0), req(1), "KV cache holds only 16"),
            (vec![-1], req(1), "prompt token ids"),
            (prompt(3, 0), req(0), "max_tokens"),
            (prompt(3, 0), RequestParams { top_p: 1.5, ..req(1) }, "top_p"),
        ];
        for (p, r, msg) in cases {
            match s.add_request(1, &p, &r) {
                Err(Error::Invalid(m)) => assert!(m.contains(msg), "{m}"),
                other => panic!("expected an error with {msg:?}, got {other:?}"),
            }
        }
        assert!(!s.has_unfinished());
        s.add_request(1, &prompt(3, 0), &req(1)).unwrap();
        let dup = s.add_request(1, &prompt(3, 0), &req(1)).unwrap_err();
        assert!(dup.to_string().contains("already in use"));
        assert!(s.add_request(-1, &prompt(3, 0), &req(1)).is_err());
        assert!(Scheduler::new(SchedulerConfig { block_size: 0, ..cfg(4, 4) }).is_err());
    }

    #[test]
    fn calls_out_of_order_are_errors() {
        let mut s = Scheduler::new(cfg(8, 4)).unwrap();
        assert!(matches!(s.update(&[1]), Err(Error::State(_))));
        assert!(matches!(s.sample(&[], 0, 4, None), Err(Error::State(_))));
        s.add_request(1, &prompt(3, 0), &req(2)).unwrap();
        s.schedule().unwrap();
        assert!(matches!(s.update(&[1, 2]), Err(Error::Invalid(_))));
        assert!(matches!(s.sample(&[0.0; 8], 2, 4, None), Err(Error::Invalid(_))));
        let out = s.sample(&[0.0, 1.0, 0.5, 0.2], 1, 4, None).unwrap();
        assert_eq!(out[0].token, 1);
        assert_eq!(s.update(&[out[0].token]).unwrap().len(), 1);
    }

    #[test]
    fn sample_bans_end_tokens_before_min_tokens() {
        let mut s = Scheduler::new(cfg(8, 4)).unwrap();
        s.add_request(1, &prompt(3, 0), &RequestParams { min_tokens: 1, ..req(4) }).unwrap();
        s.schedule().unwrap();
        // Token 0 is the end token and has the highest logit.
        let out = s.sample(&[9.0, 1.0, 0.5], 1, 3, None).unwrap();
        assert_eq!(out[0].token, 1);
    }

    // ---- grammars ------------------------------------------------------

    mod constrained {
        use super::*;
        use crate::grammar::testing::{lark, special, tok, vocab};
        use crate::grammar::GrammarCompiler;

        fn setup() -> (Scheduler, GrammarCompiler, usize, u32) {
            let (words, eos) = vocab();
            let v = words.len();
            let compiler = GrammarCompiler::new(words, &[eos], v, 8, None).unwrap();
            let mut c = cfg(64, 4);
            c.eos_token_ids = vec![eos as i64];
            (Scheduler::new(c).unwrap(), compiler, v, eos)
        }

        /// Logits that favour `best` (then every other token equally).
        fn favour(v: usize, rows: &[u32]) -> Vec<f32> {
            rows.iter().flat_map(|&best| (0..v).map(move |t| if t as u32 == best { 5.0 } else { 0.0 })).collect()
        }

        /// One step: schedule, masks, sample from `want` logits, update.
        fn step(s: &mut Scheduler, v: usize, want: &[u32]) -> Vec<StepOutput> {
            let plan = s.schedule().unwrap();
            s.start_masks().unwrap();
            let n = plan.sample_seq_ids.len();
            let out = s.sample(&favour(v, &want[..n]), n, v, None).unwrap();
            s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap()
        }

        #[test]
        fn the_mask_is_hard_and_the_grammar_ends_the_sequence() {
            let (mut s, c, v, _) = setup();
            let g = c.compile(&lark("start: \"yes\" | \"no\"")).unwrap();
            s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
            s.add_request(2, &prompt(5, 1), &req(10)).unwrap();
            // Both favour "a": only the free row may take it.
            let out = step(&mut s, v, &[tok("a"), tok("a")]);
            assert_ne!(out[0].token, i64::from(tok("a")));
            assert_eq!(out[1].token, i64::from(tok("a")));
            // "n" is followed by the forced "o", which completes the grammar:
            // finish "stop" without an end token.
            assert_eq!(out[0].token, i64::from(tok("n")));
            assert_eq!(out[0].forced, vec![tok("o")]);
            assert_eq!(out[0].finish_reason, Some(FinishReason::Stop));
            s.add_constrained(3, &prompt(5, 2), &req(10), Some(&g), Steering::default()).unwrap();
            let out = step(&mut s, v, &[tok("a"), tok("yes")]);
            assert_eq!((out[1].token, out[1].finish_reason), (i64::from(tok("yes")), Some(FinishReason::Stop)));
            let stats: HashMap<_, _> = s.stats().into_iter().collect();
            assert_eq!(stats["mask_rows"], 2);
            assert_eq!(stats["forced_tokens"], 1);
        }

        #[test]
        fn fast_forward_appends_forced_tokens_as_a_chunk() {
            let (mut s, c, _, _) = setup();
            let g = c.compile(&lark("start: \"a\" \"name\" \"b\"")).unwrap();
            // "a" is forced from the start: appended to the output at once.
            let forced = s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
            assert!(!forced.is_empty());
            let plan = s.schedule().unwrap();
            assert_eq!(plan.num_tokens, 5 + forced.len());
            assert_eq!(plan.positions.last(), Some(&((4 + forced.len()) as i64)));
            assert_eq!(s.counters().forced_tokens, forced.len());
        }

        #[test]
        fn fast_forward_off_samples_the_same_tokens() {
            let run = |ff: bool| {
                let (mut s, c, v, eos) = setup();
                let g = c.compile(&lark("start: \"ab\" /[0-9]/ \"cd\"")).unwrap();
                let mut toks: Vec<u32> = s.add_constrained(1, &prompt(5, 0), &RequestParams { fast_forward: ff, ..req(20) }, Some(&g), Steering::default()).unwrap();
                for _ in 0..20 {
                    let Some(plan) = s.schedule() else { break };
                    let n = plan.sample_seq_ids.len();
                    let out = s.sample(&favour(v, &vec![tok("7"); n]), n, v, None).unwrap();
                    for o in s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap() {
                        toks.extend(u32::try_from(o.token));
                        toks.extend(o.forced);
                    }
                }
                let text: Vec<u8> = toks.iter().filter(|&&t| t != eos).flat_map(|&t| vocab().0[t as usize].clone()).collect();
                (String::from_utf8(text).unwrap(), s.counters().forced_tokens)
            };
            let (on, forced_on) = run(true);
            let (off, forced_off) = run(false);
            assert_eq!(on, "ab7cd");
            assert_eq!(off, on);
            assert!(forced_on > 0);
            assert_eq!(forced_off, 0);
        }

        #[test]
        fn a_rejected_token_fails_the_row_with_a_message() {
            let (mut s, c, _, _) = setup();
            let g = c.compile(&lark("start: \"yes\"")).unwrap();
            s.add_constrained(1, &prompt(5, 0), &RequestParams { fast_forward: false, ..req(10) }, Some(&g), Steering::default()).unwrap();
            s.schedule().unwrap();
            let out = s.update(&[i64::from(tok("q"))]).unwrap();
            assert_eq!(out[0].finish_reason, Some(FinishReason::Error));
            assert_eq!(out[0].token, -1);
            assert!(out[0].error.as_deref().unwrap().contains("not allowed"));
            assert!(!s.has_unfinished());
        }

        #[test]
        fn masks_started_then_aborted_or_never_sampled_are_fine() {
            let (mut s, c, v, _) = setup();
            let g = c.compile(&lark("start: /[a-z]+/")).unwrap();
            s.add_constrained(1, &prompt(5, 0), &req(10), Some(&g), Steering::default()).unwrap();
            s.add_constrained(2, &prompt(5, 1), &req(10), Some(&g), Steering::default()).unwrap();
            s.schedule().unwrap();
            s.start_masks().unwrap();
            s.abort(1);
            let out = s.sample(&favour(v, &[tok("1"), tok("1")]), 2, v, None).unwrap();
            assert_eq!(out[0].token, -1);
            assert!(out[1].token >= 0 && out[1].token != i64::from(tok("1")));
            // A plan whose masks were started but never sampled.
            s.schedule().unwrap();
            s.start_masks().unwrap();
            s.schedule().unwrap();
            let out = step(&mut s, v, &[tok("x")]);
            assert_eq!(out[0].finish_reason, None);
        }

        #[test]
        fn tokens_forced_at_the_start_are_not_counted_as_a_cached_prompt() {
            let (mut s, c, v, _) = setup();
            let g = c.compile(&lark(r#"start: "abcdefgh" /[a-z]+/"#)).unwrap();
            let (p, ff) = (prompt(8, 0), RequestParams { fast_forward: true, ..req(12) });
            for id in [1u64, 2] {
                assert_eq!(s.add_constrained(id.into(), &p, &ff, Some(&g), Steering::default()).unwrap().len(), 8);
                let out = step(&mut s, v, &[tok("x")]);
                // the second finds prompt and forced tokens in the cache
                assert_eq!(out[0].num_cached_tokens, if id == 1 { 0 } else { 8 });
                s.abort(id);
            }
            let stats: HashMap<_, _> = s.stats().into_iter().collect();
            assert_eq!((stats["prefix_cache_hit_tokens"], stats["prefix_cache_queries"]), (8, 16));
        }

        /// Run one closing request whose model always wants `want`; its text.
        fn closed_run(grammar: &str, max_tokens: i64, want: u32) -> (String, Option<FinishReason>, Option<String>) {
            scripted_run(grammar, max_tokens, &[want])
        }

        /// The same, with a model that wants `script[i]` at step i (the last
        /// one from then on).
        fn scripted_run(grammar: &str, max_tokens: i64, script: &[u32]) -> (String, Option<FinishReason>, Option<String>) {
            let (toks, reason, error) = steered_run(grammar, max_tokens, Steering::CLOSE, script);
            let text: Vec<u8> = toks.iter().flat_map(|&t| vocab().0[t as usize].clone()).collect();
            (String::from_utf8(text).unwrap(), reason, error)
        }

        /// Its tokens (end tokens left out), with any `steering`.
        fn steered_run(grammar: &str, max_tokens: i64, steering: Steering, script: &[u32]) -> (Vec<u32>, Option<FinishReason>, Option<String>) {
            let (mut s, c, v, eos) = setup();
            let g = c.compile(grammar).unwrap();
            let mut toks = s.add_constrained(1, &prompt(5, 0), &req(max_tokens), Some(&g), steering).unwrap();
            let mut last = (None, None);
            for i in 0..40 {
                let Some(plan) = s.schedule() else { break };
                let n = plan.sample_seq_ids.len();
                let want = script[i.min(script.len() - 1)];
                let out = s.sample(&favour(v, &vec![want; n]), n, v, None).unwrap();
                for o in s.update(&out.iter().map(|o| o.token).collect::<Vec<_>>()).unwrap() {
                    toks.extend(u32::try_from(o.token));
                    toks.extend(o.forced);
                    last = (o.finish_reason, o.error);
                }
            }
            assert!(toks.len() <= max_tokens as usize, "{toks:?}");
            toks.retain(|&t| t != eos);
            (toks, last.0, last.1)
        }

        fn object_schema() -> String {
            r#"{"grammars": [{"json_schema": {"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": "integer"}}, "required": ["s", "n"], "additionalProperties": false}}]}"#.into()
        }

        #[test]
        fn at_the_budget_the_output_is_closed_not_cut() {
            // The model would write "a" forever inside the string.
            let (text, reason, _) = closed_run(&object_schema(), 20, tok("a"));
            assert_eq!(reason, Some(FinishReason::Length));
            assert!(text.starts_with("{") && text.contains("\"s\"") && text.ends_with('}'), "{text}");
            assert!(text.replace(' ', "").ends_with(r#"","n":1}"#), "{text}");
            // A regex grammar closes too.
            let (text, reason, _) = closed_run(&lark("start: /x[a-c]+y/"), 6, tok("a"));
            assert_eq!((text.as_str(), reason), ("xaaaay", Some(FinishReason::Length)));
        }

        #[test]
        fn a_completion_through_a_byte_the_model_never_writes_is_found() {
            // The lexeme /[a-z]*-/ ends only with a "-" the model never writes: the search
            // leaves it by its shortest way out, whatever the model wrote into it.
            let g = lark("start: /[a-z]*-/ /[a-z]*/ \"]\"");
            let (text, reason, err) = scripted_run(&g, 12, &[tok("a"), tok("b"), tok("-"), tok("c")]);
            assert_eq!((text.as_str(), reason), ("ab-cccccccc]", Some(FinishReason::Length)), "{err:?}");
            let (text, reason, error) = closed_run(&g, 8, tok("a"));
            assert_eq!((text.as_str(), reason, error), ("aaaaaa-]", Some(FinishReason::Length), None));
        }

        #[test]
        fn a_step_that_opens_what_cannot_close_in_time_is_taken_back() {
            // After "x" the output may end; "," opens 30 digits that no
            // longer fit: the step is undone and the output ends at "x".
            let g = lark("start: /[a-z]/ (\",\" /[0-9]{30}/)*");
            let (text, reason, error) = scripted_run(&g, 24, &[tok("x"), tok(","), tok("1")]);
            assert_eq!((text.as_str(), reason, error), ("x", Some(FinishReason::Stop), None));
        }

        #[test]
        fn a_reasoning_block_ends_at_its_budget() {
            // The model would reason forever; from output length 4 on, the
            // end token replaces what it samples, and the answer follows.
            let (think, end) = (special("<think>"), special("</think>"));
            let g = lark(&format!("start: <[{think}]> /[a-z]*/ <[{end}]> \"ok\""));
            let steering = Steering { close_on_length: false, reasoning_end: Some((end, 4)) };
            let (toks, reason, _) = steered_run(&g, 20, steering, &[think, tok("a")]);
            let a = tok("a");
            assert_eq!(toks, vec![think, a, a, a, end, tok("o"), tok("k")]);
            assert_eq!(reason, Some(FinishReason::Stop));
        }

        #[test]
        fn a_reasoning_end_not_allowed_at_its_length_comes_a_token_later() {
            // At the budget the text is half of a pair ("a" of "ac"), as a
            // UTF-8 character half written byte by byte (its second byte
            // not forced: "c" or "d" may follow): the end comes once the
            // pair is whole.
            let (think, end) = (special("<think>"), special("</think>"));
            let g = lark(&format!("start: <[{think}]> /([ab][cd])*/ <[{end}]> \"ok\""));
            let steering = Steering { close_on_length: false, reasoning_end: Some((end, 4)) };
            let (a, c) = (tok("a"), tok("c"));
            // (the grammar forces the block's start: the script is what follows)
            let script: Vec<u32> = [a, c].into_iter().cycle().take(40).collect();
            let (toks, reason, _) = steered_run(&g, 20, steering, &script);
            assert_eq!(toks, vec![think, a, c, a, c, end, tok("o"), tok("k")]);
            assert_eq!(reason, Some(FinishReason::Stop));
        }

        #[test]
        fn a_budget_below_the_shortest_output_is_an_error() {
            let (_, reason, error) = closed_run(&object_schema(), 5, tok("a"));
            assert_eq!(reason, Some(FinishReason::Error));
            assert!(error.unwrap().contains("shortest output the grammar allows needs"));
        }

        #[test]
        fn end_tokens_are_allowed_where_the_grammar_accepts_despite_min_tokens() {
            let (mut s, c, v, eos) = setup();
            let g = c.compile(&lark("start: /[a-z]+/")).unwrap();
            let r = RequestParams { min_tokens: 5, ..req(10) };
            s.add_constrained(1, &prompt(5, 0), &r, Some(&g), Steering::default()).unwrap();
            step(&mut s, v, &[tok("x")]);
            let out = step(&mut s, v, &[eos]);
            assert_eq!(out[0].token, i64::from(eos));
            assert_eq!(out[0].finish_reason, Some(FinishReason::Stop));
        }
    }

    // ---- simulation against a fake model -------------------------------

    /// A fake KV cache: each slot remembers the token written there. The
    /// "model" reads a row's whole context through its block table, checks
    /// it against the sequence's true tokens, and answers with a token that
    /// depends only on that context; so every schedule, however chunked,
    /// cached or preempted, must give the same outputs.
    struct FakeModel {
        slots: Vec<Option<i64>>,
    }

    impl FakeModel {
        fn step(&mut self, s: &Scheduler, plan: &StepPlan, truth: &HashMap<u64, Vec<i64>>) -> Vec<i64> {
            for (slot, &tok) in plan.slot_mapping.iter().zip(&plan.input_ids) {
                self.slots[*slot as usize] = Some(tok);
            }
            let bs = s.cfg.block_size;
            let mut out = Vec::new();
            for (row, &id) in plan.seq_ids.iter().enumerate() {
                let ctx = plan.context_lens[row] as usize;
                let table = &plan.block_tables[row * plan.max_blocks..(row + 1) * plan.max_blocks];
                let seen: Vec<i64> = (0..ctx)
                    .map(|p| self.slots[table[p / bs] as usize * bs + p % bs].expect("slot written"))
                    .collect();
                let want = &truth[&(id as u64)][..ctx];
                assert_eq!(&seen[..], want, "KV of seq {id} through its block table");
                let end = plan.query_start_loc[row + 1] as i64 - 1;
                if plan.logits_indices.contains(&end) {
                    let h = seen.iter().fold(17i64, |h, &t| (h * 31 + t) % 1_000_003);
                    out.push(1 + h % 40);
                }
            }
            out
        }
    }

    type Outputs = HashMap<u64, Vec<i64>>;

    fn simulate(c: SchedulerConfig, reqs: &[(Vec<i64>, i64)], aborts: &[(usize, u64)]) -> Outputs {
        simulate_counting(c, reqs, aborts).0
    }

    fn simulate_counting(c: SchedulerConfig, reqs: &[(Vec<i64>, i64)], aborts: &[(usize, u64)]) -> (Outputs, Counters) {
        let mut s = Scheduler::new(c.clone()).unwrap();
        let mut model = FakeModel { slots: vec![None; c.num_blocks * c.block_size] };
        let mut truth = HashMap::new();
        for (id, (p, max_tokens)) in reqs.iter().enumerate() {
            s.add_request(id as i128, p, &req(*max_tokens)).unwrap();
            truth.insert(id as u64, p.clone());
        }
        let mut done = HashMap::new();
        for step in 0..5_000 {
            for &(_, id) in aborts.iter().filter(|(at, _)| *at == step) {
                s.abort(id);
            }
            let Some(plan) = s.schedule() else { break };
            assert!(plan.num_tokens <= c.max_num_batched_tokens);
            assert!(plan.seq_ids.len() <= c.max_num_seqs);
            let mut slots = plan.slot_mapping.clone();
            slots.sort_unstable();
            slots.dedup();
            assert_eq!(slots.len(), plan.num_tokens, "no two tokens share a slot");
            let tokens = model.step(&s, &plan, &truth);
            for o in s.update(&tokens).unwrap() {
                let t = truth.get_mut(&o.seq_id).unwrap();
                t.push(o.token);
                if o.finish_reason.is_some() {
                    done.insert(o.seq_id, t[reqs[o.seq_id as usize].0.len()..].to_vec());
                }
            }
        }
        assert!(!s.has_unfinished(), "everything finishes");
        assert_eq!(s.bm.num_free_blocks(), c.num_blocks, "no leaked blocks");
        (done, s.counters())
    }

    #[test]
    fn tight_pool_preempts_and_hits_yet_matches_a_roomy_one() {
        let reqs: Vec<(Vec<i64>, i64)> = (0..6).map(|i| (prompt(20 + i, (i % 2) as i64 * 3), 12)).collect();
        let roomy = SchedulerConfig {
            num_blocks: 512, block_size: 4, max_num_seqs: 64, max_num_batched_tokens: 4096,
            max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: false,
        };
        let tight = SchedulerConfig { num_blocks: 14, max_num_seqs: 4, max_num_batched_tokens: 10, enable_prefix_caching: true, ..roomy.clone() };
        let (want, _) = simulate_counting(roomy, &reqs, &[]);
        let (got, counters) = simulate_counting(tight, &reqs, &[]);
        assert_eq!(got, want);
        assert!(counters.preemptions > 0, "{counters:?}");
        assert!(counters.prefix_cache_hit_tokens > 0, "{counters:?}");
    }

    fn workload() -> impl Strategy<Value = Vec<(Vec<i64>, i64)>> {
        // Prompts drawn from two shared stems so that the cache gets hits.
        let one = (0usize..2, 1usize..30, prop::collection::vec(1i64..6, 0..6), 1i64..12)
            .prop_map(|(stem, keep, tail, max_tokens)| {
                let stems = [prompt(30, 0), prompt(30, 3)];
                let mut p = stems[stem][..keep].to_vec();
                p.extend(tail);
                (p, max_tokens)
            });
        prop::collection::vec(one, 1..8)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn any_schedule_gives_the_same_outputs(
            reqs in workload(),
            num_blocks in 12usize..40,
            budget in 1usize..48,
            max_num_seqs in 1usize..6,
            caching in any::<bool>(),
        ) {
            let roomy = SchedulerConfig {
                num_blocks: 512, block_size: 4, max_num_seqs: 64, max_num_batched_tokens: 4096,
                max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: false,
            };
            let tight = SchedulerConfig {
                num_blocks, max_num_seqs, max_num_batched_tokens: budget,
                enable_prefix_caching: caching, ..roomy.clone()
            };
            let reference = simulate(roomy, &reqs, &[]);
            prop_assert_eq!(simulate(tight, &reqs, &[]), reference);
        }

        #[test]
        fn aborts_never_leak(reqs in workload(), aborts in prop::collection::vec((0usize..20, 0u64..8), 0..6)) {
            let c = SchedulerConfig {
                num_blocks: 16, block_size: 4, max_num_seqs: 4, max_num_batched_tokens: 16,
                max_model_len: 48, eos_token_ids: vec![0], enable_prefix_caching: true,
            };
            simulate(c, &reqs, &aborts);
        }
    }
}
