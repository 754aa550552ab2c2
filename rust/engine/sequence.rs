//! Per-request token state.

use crate::engine::block_manager::SeqBlocks;
use crate::grammar::closing::{shortest_completion, Closer, Closing, MAX_BYTES};
use crate::grammar::matchers::{Grammar, GrammarMatcher, MAX_FF_ROUNDS};
use crate::engine::speculative::{Draft, Speculation};
use crate::sampling::random::Stream;
use crate::sampling::cpu_sampler::SamplingParams;

pub type SeqId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Finished,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// When to stop generating.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StopParams {
    pub max_tokens: usize,
    /// End tokens and stop tokens do not stop generation before this many
    /// output tokens (and are not sampled before then).
    pub min_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
}

/// A request as the client gave it, before validation: signed and wide types
/// so that every bad value gets a clear message instead of an overflow.
///
/// The one record that crosses the boundary: with the `python` feature it is
/// read field by field, by name, from Python's `guided.SamplingParams`, so a
/// new sampling field is added there and here (and used where it applies).
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "python", derive(pyo3::FromPyObject))]
pub struct RequestParams {
    pub max_tokens: i64,
    pub temperature: f64,
    pub top_p: f64,
    pub top_k: i64,
    pub min_p: f64,
    /// Any Python int comes in; only [0, 2**64) is accepted.
    pub seed: Option<i128>,
    pub presence_penalty: f64,
    pub frequency_penalty: f64,
    pub repetition_penalty: f64,
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub min_tokens: i64,
    /// Added to the logits of these tokens (OpenAI's logit_bias).
    pub logit_bias: LogitBias,
    /// Report logprobs with this many top alternatives (0..=MAX_TOP_LOGPROBS).
    pub logprobs: Option<i64>,
    /// Under a grammar, append the tokens it forces without sampling them.
    pub fast_forward: bool,
    /// Draft tokens and check them in one forward pass (speculative.rs);
    /// None: as the engine is set.
    pub speculative: Option<bool>,
}

/// (token, bias) pairs, by token; read from a `{token: bias}` dict or None
/// on the Python side (bindings/python.rs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LogitBias(pub Vec<(i64, f64)>);

/// The most top alternatives a request may ask for per token (OpenAI's 20).
pub const MAX_TOP_LOGPROBS: i64 = 20;

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 16,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            logit_bias: LogitBias::default(),
            logprobs: None,
            fast_forward: true,
            speculative: None,
        }
    }
}

/// A request's validated parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    pub sampling: SamplingParams,
    pub stop: StopParams,
    pub seed: Option<u64>,
}

impl RequestParams {
    pub fn validate(&self) -> Result<Validated, String> {
        if self.max_tokens < 1 {
            return Err(format!("max_tokens must be at least 1, got {}", self.max_tokens));
        }
        if self.min_tokens < 0 {
            return Err(format!("min_tokens must be >= 0, got {}", self.min_tokens));
        }
        if self.top_k < 0 {
            return Err(format!("top_k must be >= 0 (0 disables it), got {}", self.top_k));
        }
        if let Some(n) = self.logprobs.filter(|n| !(0..=MAX_TOP_LOGPROBS).contains(n)) {
            return Err(format!("logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {n}"));
        }
        let sampling = SamplingParams {
            temperature: self.temperature as f32,
            top_p: self.top_p as f32,
            top_k: usize::try_from(self.top_k).unwrap_or(usize::MAX),
            min_p: self.min_p as f32,
            presence_penalty: self.presence_penalty as f32,
            frequency_penalty: self.frequency_penalty as f32,
            repetition_penalty: self.repetition_penalty as f32,
            logit_bias: self.logit_bias()?,
            logprobs: self.logprobs.map(|n| n as usize),
        };
        sampling.validate()?;
        let stop = StopParams {
            max_tokens: self.max_tokens as usize,
            min_tokens: self.min_tokens as usize,
            stop_token_ids: token_ids("stop_token_ids", &self.stop_token_ids)?,
            ignore_eos: self.ignore_eos,
        };
        let seed = match self.seed {
            None => None,
            Some(s) => Some(u64::try_from(s).map_err(|_| format!("seed must be in [0, 2**64), got {s}"))?),
        };
        Ok(Validated { sampling, stop, seed })
    }
}

impl RequestParams {
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, String> {
        let ids: Vec<i64> = self.logit_bias.0.iter().map(|b| b.0).collect();
        let ids = token_ids("logit_bias token ids", &ids)?;
        Ok(ids.into_iter().zip(&self.logit_bias.0).map(|(t, b)| (t, b.1 as f32)).collect())
    }
}

/// Token ids from Python ints, each in [0, 2**32).
pub fn token_ids(what: &str, ids: &[i64]) -> Result<Vec<u32>, String> {
    ids.iter()
        .map(|&t| u32::try_from(t).map_err(|_| format!("{what} must be in [0, 2**32), got {t}")))
        .collect()
}

/// How a constrained output is steered beyond its mask.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Steering {
    /// Near the budget, steer to the shortest valid completion instead of
    /// cutting the output (see [`crate::grammar::closing`]).
    pub close_on_length: bool,
    /// A closed output reports finish_reason "length", as a cut one does,
    /// instead of ending on an end token with "stop".
    pub closed_as_length: bool,
    /// The end token of a reasoning block and the output length by which
    /// it must come: from there on the end token replaces the sampled one
    /// where the grammar allows it (a reasoning budget; llguidance's own
    /// `max_tokens` on a rule would forbid the rollback the closing needs).
    pub reasoning_end: Option<(u32, usize)>,
}

impl Steering {
    pub const CLOSE: Steering = Steering { close_on_length: true, closed_as_length: false, reasoning_end: None };
}

/// The grammar of a constrained sequence.
#[derive(Debug, Clone)]
pub struct Constraint {
    /// None while the mask thread holds it.
    pub matcher: Option<GrammarMatcher>,
    /// Append forced tokens without sampling them.
    pub fast_forward: bool,
    /// Why the last mask allowed nothing.
    pub mask_error: Option<String>,
    /// Near the budget, steer to the shortest valid completion instead of
    /// cutting the output (None: cut).
    pub closer: Option<Closer>,
    /// See [`Steering::closed_as_length`].
    pub closed_as_length: bool,
    /// See [`Steering::reasoning_end`]; None once checked.
    pub reasoning_end: Option<(u32, usize)>,
}

/// What appending one sampled token did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Commit {
    /// False when the token was not appended (nothing allowed, or rejected).
    pub appended: bool,
    /// Tokens the grammar forced after it, appended without sampling.
    pub forced: Vec<u32>,
    pub reason: Option<FinishReason>,
    pub error: Option<String>,
    /// The token appended instead of the sampled one (the output was steered
    /// to a valid end; see [`crate::grammar::closing`]).
    pub replaced_by: Option<u32>,
    /// The budget's closing wrote the end of the output (crate::grammar::closing):
    /// the structure is whole, a value may be short.
    pub closed: bool,
}

/// What a step that carried a draft appended (speculative.rs): the first
/// draw's commit, then the tokens later draws appended (`more_forced` of
/// them forced), and the draft tokens kept (their KV is valid).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Verified {
    pub first: Commit,
    pub more: Vec<u32>,
    pub more_forced: usize,
    pub kept: usize,
    /// The reason, error and closing of the last commit (the first's when alone).
    pub reason: Option<FinishReason>,
    pub error: Option<String>,
    pub closed: bool,
    /// Once it finished: the time its closing took in all (crate::grammar::closing).
    pub closing_us: u64,
}

impl From<Commit> for Verified {
    /// A step without a draft: its one commit.
    fn from(first: Commit) -> Self {
        Verified { reason: first.reason, error: first.error.clone(), closed: first.closed, first, ..Default::default() }
    }
}

impl Commit {
    fn failed(appended: bool, msg: String) -> Self {
        Commit { appended, reason: Some(FinishReason::Error), error: Some(msg), ..Default::default() }
    }
}


#[derive(Debug, Clone)]
pub struct Sequence {
    pub seq_id: SeqId,
    /// Prompt followed by output.
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose KV is in the cache (or is written by the step in flight).
    pub num_computed_tokens: usize,
    pub blocks: SeqBlocks,
    pub status: Status,
    pub sampling: SamplingParams,
    pub stop: StopParams,
    pub rng: Stream,
    /// Prefix-cache hit at first admission (reported to the user).
    pub num_cached_tokens: Option<usize>,
    /// A hit must be exactly this many tokens or none (`Scheduler::limit_prefix`).
    pub cache_limit: Option<usize>,
    /// Admission order among all requests, for FIFO and preemption.
    pub arrival: u64,
    pub constraint: Option<Constraint>,
    /// Its draft length, where it speculates.
    pub speculation: Option<Speculation>,
}

impl Sequence {
    pub fn new(
        seq_id: SeqId,
        prompt: Vec<u32>,
        sampling: SamplingParams,
        stop: StopParams,
        seed: Option<u64>,
        arrival: u64,
    ) -> Self {
        Sequence {
            seq_id,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            num_computed_tokens: 0,
            blocks: SeqBlocks::default(),
            status: Status::Waiting,
            sampling,
            stop,
            rng: Stream::new(seed),
            num_cached_tokens: None,
            cache_limit: None,
            arrival,
            constraint: None,
            speculation: None,
        }
    }

    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    pub fn prompt(&self) -> &[u32] {
        &self.token_ids[..self.num_prompt_tokens]
    }

    pub fn output(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens..]
    }

    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Tokens still to be fed to the model.
    pub fn num_uncomputed(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    /// Tokens that stop generation: the end set (unless ignored) plus the
    /// request's own stop tokens.
    pub fn stoppers<'a>(&'a self, eos: &'a [u32]) -> impl Iterator<Item = u32> + 'a {
        let eos: &[u32] = if self.stop.ignore_eos { &[] } else { eos };
        eos.iter().chain(&self.stop.stop_token_ids).copied()
    }

    /// Stoppers may not be sampled until min_tokens outputs exist. Under a
    /// grammar, the grammar alone decides where the output may end.
    pub fn banned_tokens(&self, eos: &[u32]) -> Vec<u32> {
        self.banned_after(eos, 0)
    }

    /// [`banned_tokens`](Self::banned_tokens) once `drafted` more tokens are output.
    pub fn banned_after(&self, eos: &[u32], drafted: usize) -> Vec<u32> {
        if self.constraint.is_none() && self.num_output_tokens() + drafted < self.stop.min_tokens {
            self.stoppers(eos).collect()
        } else {
            Vec::new()
        }
    }

    /// Append a sampled token; the reason to finish, if any. `max_len` is the
    /// longest the sequence may get (context or KV pool, whichever is less).
    pub fn append(&mut self, token: u32, eos: &[u32], max_len: usize) -> Option<FinishReason> {
        self.token_ids.push(token);
        let n = self.num_output_tokens();
        let may_stop = self.constraint.is_some() || n > self.stop.min_tokens;
        if may_stop && self.stoppers(eos).any(|t| t == token) {
            return Some(FinishReason::Stop);
        }
        self.length_reached(max_len)
    }

    /// "length" once the output has max_tokens or the sequence fills `max_len`.
    fn length_reached(&self, max_len: usize) -> Option<FinishReason> {
        (self.num_output_tokens() >= self.stop.max_tokens || self.len() >= max_len).then_some(FinishReason::Length)
    }

    /// [`Self::append`] under a grammar: an end token the grammar took as one
    /// of its own tokens (one the grammar writes: GigaChat's <|message_sep|>,
    /// which opens a call turn after the answer) ends the output only where
    /// the grammar may end.
    fn append_under(&mut self, m: &mut GrammarMatcher, token: u32, eos: &[u32], max_len: usize) -> Option<FinishReason> {
        let reason = self.append(token, eos, max_len);
        if reason == Some(FinishReason::Stop) && eos.contains(&token) && !m.is_stopped() && !m.is_accepting() {
            return self.length_reached(max_len);
        }
        reason
    }
}

impl Sequence {
    /// Attach a grammar; with fast-forward, the tokens it forces at the very
    /// start are appended at once (returned; they are computed with the
    /// prompt). Forced tokens that would reach max_tokens are left to
    /// sampling. With `close_on_length`, the output is steered to a complete
    /// one before the budget runs out (see [`crate::grammar::closing`]); Err (and
    /// nothing attached) where the shortest complete one cannot fit.
    pub fn constrain(&mut self, grammar: &Grammar, fast_forward: bool, steering: Steering, max_len: usize) -> Result<Vec<u32>, String> {
        let out = self.start(grammar, fast_forward, fast_forward, steering, max_len);
        match out {
            // The forced tokens may split what one token writes (`get_` `time`
            // where `get_time` is one): without them, sampled instead, the
            // shortest output may still fit.
            Err(_) if fast_forward => self.start(grammar, true, false, steering, max_len),
            out => out,
        }
    }

    /// [`Self::constrain`], appending the tokens forced at the start where
    /// `take_forced`; on Err the sequence is left as it was.
    fn start(&mut self, grammar: &Grammar, fast_forward: bool, take_forced: bool, steering: Steering, max_len: usize) -> Result<Vec<u32>, String> {
        let mut matcher = grammar.matcher();
        // Also caches them for the first mask, so the mask thread need not tokenize.
        let mut forced = matcher.forced_tokens();
        if !take_forced || forced.len() >= self.stop.max_tokens {
            forced.clear();
        } else {
            let n = matcher.advance(&forced).unwrap_or(0);
            forced.truncate(n);
            self.token_ids.extend(&forced);
            matcher.forced_tokens();
        }
        let mut c = Constraint {
            matcher: None,
            fast_forward,
            mask_error: None,
            closer: None,
            closed_as_length: steering.closed_as_length,
            reasoning_end: steering.reasoning_end,
        };
        if steering.close_on_length {
            let mut closer = Closer::default();
            let left = self.remaining(max_len);
            // Within the budget first (a tighter search); the longer search
            // only to say how much is needed.
            // (the same search for every request of this grammar: found once)
            let search = |budget| {
                let tokens = grammar.from_start((forced.len(), budget), || shortest_completion(&matcher, budget).map(|c| c.tokens));
                tokens.map(|tokens| Closing { bytes: matcher.bytes_of(&tokens), tokens })
            };
            let started = std::time::Instant::now();
            let found = search(left).or_else(|| search(MAX_BYTES));
            closer.spent_us = started.elapsed().as_micros() as u64;
            match found {
                Some(t) if t.tokens.len() <= left => {
                    // Room for the end token after the closing, where there is any.
                    let ends = !steering.closed_as_length && !self.stop.ignore_eos;
                    closer.reserve = usize::from(ends && t.tokens.len() < left);
                    closer.record(t, left - closer.reserve);
                }
                // (counted from the output's start: forced tokens are output too)
                Some(t) => {
                    self.token_ids.truncate(self.token_ids.len() - forced.len());
                    return Err(too_long(forced.len() + t.tokens.len(), forced.len() + left));
                }
                // Beyond what the search finds from the start (a pattern it
                // cannot write, say): searched again as the output grows,
                // and cut, as without closing, where none is ever found.
                None => closer.record_miss(left),
            }
            c.closer = Some(closer);
        }
        c.matcher = Some(matcher);
        self.constraint = Some(c);
        Ok(forced)
    }

    /// Microseconds spent on the closing so far (searches, fit checks).
    pub fn closing_us(&self) -> u64 {
        self.constraint.as_ref().and_then(|c| c.closer.as_ref()).map_or(0, |c| c.spent_us)
    }

    /// Output tokens that may still be appended: max_tokens or the context,
    /// whichever ends first.
    pub fn remaining(&self, max_len: usize) -> usize {
        let by_tokens = self.stop.max_tokens.saturating_sub(self.num_output_tokens());
        by_tokens.min(max_len.saturating_sub(self.len()))
    }

    /// Commit the draws of a step that carried `draft` one by one, as steps
    /// without it would have (the same commit, closing and reasoning budget
    /// included), while the tokens appended equal the draft's: the draw at
    /// row r was made after draft token r - 1 (`streams[r]`: the random
    /// stream after it; None: not drawn). The sequence keeps the stream
    /// after the last draw used, and counts as computed its real tokens and
    /// the draft tokens kept, but never a finished step's nor its last token.
    pub fn commit_drafted(&mut self, draft: &Draft, draws: &[i64], streams: &[Option<Stream>], eos: &[u32], max_len: usize) -> Verified {
        let base = self.len();
        let mut v = Verified::default();
        let mut first = None;
        let mut pos = 0;
        while let Some(Some(rng)) = streams.get(pos) {
            let before = self.len();
            let c = self.commit(draws[pos], eos, max_len);
            self.rng = *rng;
            let appended = &self.token_ids[before.min(self.len())..];
            let m = appended.iter().zip(&draft.tokens[pos..]).take_while(|(a, b)| a == b).count();
            let whole = m == appended.len();
            (v.reason, v.error, v.closed) = (c.reason, c.error.clone(), c.closed);
            if first.is_none() {
                first = Some(c.clone());
            } else if let Some((_, forced)) = appended.split_first() {
                v.more.extend(appended);
                v.more_forced += forced.len();
            }
            if c.reason.is_some() || !c.appended {
                break;
            }
            pos += m;
            if !whole {
                break;
            }
        }
        v.first = first.unwrap_or_else(|| {
            let c = self.commit(-1, eos, max_len);
            (v.reason, v.error, v.closed) = (c.reason, c.error.clone(), c.closed);
            c
        });
        v.kept = pos;
        self.num_computed_tokens = (base + pos).min(self.len().saturating_sub(1));
        v
    }

    /// Append a sampled token (-1: the mask allowed nothing), advance the
    /// grammar and append what it forces next.
    pub fn commit(&mut self, token: i64, eos: &[u32], max_len: usize) -> Commit {
        let Some(mut c) = self.constraint.take() else {
            return match u32::try_from(token) {
                Ok(t) => Commit { appended: true, reason: self.append(t, eos, max_len), ..Default::default() },
                Err(_) => Commit::failed(false, "no token was allowed at this point".into()),
            };
        };
        let out = self.commit_constrained(&mut c, token, eos, max_len);
        self.constraint = Some(c);
        out
    }

    fn commit_constrained(&mut self, c: &mut Constraint, token: i64, eos: &[u32], max_len: usize) -> Commit {
        let sampled = token;
        let token = self.end_reasoning_if_spent(c, token);
        let before = self.len();
        let mut consumed = 0;
        let mut out = self.advance_sampled(c, token, eos, max_len, &mut consumed);
        if token != sampled && out.appended {
            out.replaced_by = u32::try_from(token).ok();
        }
        if c.closer.is_some() && matches!(out.reason, None | Some(FinishReason::Length)) {
            let started = std::time::Instant::now();
            self.close_if_due(c, &mut out, before, consumed, eos, max_len);
            if let Some(closer) = c.closer.as_mut() {
                closer.spent_us += started.elapsed().as_micros() as u64;
            }
        }
        out
    }

    /// The token to append: the reasoning block's end instead of the
    /// sampled one once the block has had its budget. Where the grammar does
    /// not allow the end at that length (the text ends inside a UTF-8
    /// character written byte by byte), it is tried again for a few tokens;
    /// a block already ended, or never open, is then left alone.
    fn end_reasoning_if_spent(&self, c: &mut Constraint, token: i64) -> i64 {
        /// Tokens a character split into bytes may still take to complete.
        const RETRIES: usize = 8;
        let Some((end, at)) = c.reasoning_end else { return token };
        let n = self.num_output_tokens();
        if n < at || token < 0 {
            return token;
        }
        let allowed = c.matcher.as_ref().is_some_and(|m| m.clone().try_consume(&[end]) == Ok(1));
        if allowed || token == i64::from(end) || n >= at + RETRIES {
            c.reasoning_end = None;
        }
        if allowed {
            i64::from(end)
        } else {
            token
        }
    }

    /// Append the sampled token and what the grammar forces after it;
    /// `consumed` counts the tokens the matcher took.
    fn advance_sampled(&mut self, c: &mut Constraint, token: i64, eos: &[u32], max_len: usize, consumed: &mut usize) -> Commit {
        let Some(m) = c.matcher.as_mut() else {
            return Commit::failed(false, "internal error: the grammar state was lost".into());
        };
        let Ok(t) = u32::try_from(token) else {
            let why = c.mask_error.clone().or_else(|| m.error());
            return Commit::failed(false, why.unwrap_or_else(|| "the grammar allows no token here".into()));
        };
        // A grammar completed by forced tokens allows only the end tokens.
        let ends_done = m.is_stopped() && m.error().is_none() && eos.contains(&t);
        match if ends_done { Ok(1) } else { m.advance(&[t]) } {
            Ok(1) => {}
            _ => {
                let why = m.error().unwrap_or_else(|| "no further detail".into());
                return Commit::failed(false, format!("token {t} is not allowed by the grammar here: {why}"));
            }
        }
        *consumed += 1;
        let mut out = Commit { appended: true, reason: self.append_under(m, t, eos, max_len), ..Default::default() };
        if ends_done {
            out.reason = Some(FinishReason::Stop);
        }
        for _ in 0..MAX_FF_ROUNDS {
            if out.reason.is_some() {
                break;
            }
            if m.is_stopped() {
                match m.error() {
                    Some(e) => (out.reason, out.error) = (Some(FinishReason::Error), Some(e)),
                    None => out.reason = Some(FinishReason::Stop),
                }
                break;
            }
            // Computed even without fast-forward: it primes the next mask.
            let ff = m.forced_tokens();
            if !c.fast_forward || ff.is_empty() {
                break;
            }
            // A forced token the grammar then refuses is left unconsumed
            // (the matcher stays where it was) and is sampled instead.
            let n = match m.advance(&ff) {
                Ok(n) => n,
                Err(e) => return Commit { reason: Some(FinishReason::Error), error: Some(e), ..out },
            };
            *consumed += n;
            for &f in &ff[..n] {
                out.forced.push(f);
                out.reason = self.append_under(m, f, eos, max_len);
                if out.reason.is_some() {
                    break;
                }
            }
            if n < ff.len() {
                break; // the rest is left to sampling
            }
        }
        out
    }

    /// Go on while a valid completion still fits after this step's tokens
    /// (the last one found, checked cheaply; a new search where it no longer
    /// works), force it once it fills what is left, and where none fits take
    /// this step's tokens back and force the completion from before them
    /// (which fit, or was checked to fit, last step). The search is bounded
    /// and may miss a completion that exists, so the last one found stands
    /// beside it wherever it still completes the output
    /// ([`Closer::closing_within`]): a completion once found is never lost
    /// to a search that missed it. Checked near the
    /// budget and now and then before it (a completion grows at most a token
    /// per token sampled), and at every step that may open more than that at
    /// once: forced tokens, a special token, or leaving a point where the
    /// output could end (a step that opens a call with few tokens left).
    fn close_if_due(&mut self, c: &mut Constraint, out: &mut Commit, before: usize, consumed: usize, eos: &[u32], max_len: usize) {
        let (Some(closer), Some(m)) = (c.closer.as_mut(), c.matcher.as_mut()) else { return };
        // (the end token after the closing has its room kept)
        let left = self.remaining(max_len).saturating_sub(closer.reserve);
        let appended = m.bytes_of(&self.token_ids[before..]);
        let opens = !out.forced.is_empty() || appended.contains(&0xff) || closer.last.tokens.is_empty();
        if !closer.due(left) && (closer.missed || !opens) {
            if m.is_accepting() {
                closer.last = Default::default(); // it may end here: nothing to complete
            }
            return;
        }
        let kept = if closer.missed { None } else { closer.still_fits(m, &appended, left) };
        if !closer.due(left) && (closer.missed || kept.is_some()) {
            if let Some(kept) = kept {
                closer.last = kept;
            }
            return;
        }
        if let Some(kept) = kept {
            return closer.record(kept, left);
        }
        let as_length = c.closed_as_length;
        let searched = shortest_completion(m, left);
        if searched.is_none() && closer.missed {
            return closer.record_miss(left); // none known: cut
        }
        match closer.closing_within(m, searched, &appended, left) {
            Some(t) if t.tokens.len() < left => return closer.record(t, left),
            Some(t) => return self.force_closing(m, out, t.tokens, as_length, eos, max_len),
            None => {}
        }
        // This step's tokens left no valid completion within the budget:
        // the completion checked before them closes the output.
        let undone = m.rollback(consumed);
        self.token_ids.truncate(before);
        *out = Commit { appended: true, ..Default::default() };
        let left = self.remaining(max_len);
        let closing = undone.ok().and_then(|_| closer.closing_within(m, shortest_completion(m, left), &[], left));
        match closing.map(|c| c.tokens) {
            // Complete already: end it here, as the model may.
            Some(t) if t.is_empty() => match self.end_token(m, eos) {
                Some(e) => {
                    self.token_ids.push(e);
                    (out.replaced_by, out.reason, out.closed) = (Some(e), Some(FinishReason::Stop), true);
                }
                None => out.reason = Some(FinishReason::Length),
            },
            Some(t) => {
                let first = t[0];
                self.force_closing(m, out, t, as_length, eos, max_len);
                if out.closed {
                    out.replaced_by = Some(first);
                    out.forced.remove(0);
                }
            }
            None => *out = Commit::failed(false, format!("no complete output the grammar allows fits in the {left} tokens left")),
        }
    }

    /// Append a closing found for the matcher's state, then, where there is
    /// room and the client did not ask for "length", an end token: the
    /// output ends there, finished "stop".
    fn force_closing(&mut self, m: &mut GrammarMatcher, out: &mut Commit, closing: Vec<u32>, as_length: bool, eos: &[u32], max_len: usize) {
        match m.advance(&closing) {
            Ok(n) if n == closing.len() => {
                self.token_ids.extend(&closing);
                out.forced.extend(&closing);
                out.closed = true;
                out.reason = Some(if as_length { FinishReason::Length } else { FinishReason::Stop });
                // (a closing that ends with an end token of its own, harmony's <|call|>, needs none after it)
                let ended = closing.last().is_some_and(|&t| self.stoppers(eos).any(|e| e == t));
                if !as_length && !ended && self.remaining(max_len) > 0 {
                    if let Some(e) = self.end_token(m, eos) {
                        self.token_ids.push(e);
                        out.forced.push(e);
                    }
                }
            }
            _ => {
                let why = m.error().unwrap_or_else(|| "a token was refused".into());
                *out = Commit { error: Some(format!("internal error: the closing could not be applied: {why}")), reason: Some(FinishReason::Error), ..std::mem::take(out) };
            }
        }
    }

    /// An end token the grammar takes where it stands (consumed), unless
    /// the request ignores end tokens.
    fn end_token(&self, m: &mut GrammarMatcher, eos: &[u32]) -> Option<u32> {
        if self.stop.ignore_eos {
            return None;
        }
        if m.is_stopped() {
            return eos.first().copied().filter(|_| m.error().is_none());
        }
        let e = eos.iter().copied().find(|&e| m.clone().try_consume(&[e]) == Ok(1))?;
        (m.advance(&[e]) == Ok(1)).then_some(e)
    }
}

/// The message of a request whose shortest complete output needs more
/// tokens than it may have.
fn too_long(needed: usize, left: usize) -> String {
    format!(
        "the shortest output the grammar allows needs {needed} tokens, but max_tokens (or the context \
         left) allows only {left}: raise max_tokens to at least {needed} or relax the schema"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(stop: StopParams) -> Sequence {
        Sequence::new(1, vec![5, 6, 7], SamplingParams::default(), stop, Some(0), 0)
    }

    #[test]
    fn stops_on_any_end_token_or_stop_token() {
        let stop = StopParams { max_tokens: 10, stop_token_ids: vec![9], ..Default::default() };
        assert_eq!(seq(stop.clone()).append(2, &[1, 2], 100), Some(FinishReason::Stop));
        assert_eq!(seq(stop.clone()).append(9, &[1, 2], 100), Some(FinishReason::Stop));
        assert_eq!(seq(stop).append(3, &[1, 2], 100), None);
    }

    #[test]
    fn ignore_eos_keeps_stop_tokens() {
        let stop = StopParams { max_tokens: 10, stop_token_ids: vec![9], ignore_eos: true, ..Default::default() };
        let mut s = seq(stop);
        assert_eq!(s.append(1, &[1], 100), None);
        assert_eq!(s.append(9, &[1], 100), Some(FinishReason::Stop));
    }

    #[test]
    fn length_by_max_tokens_or_context() {
        let mut s = seq(StopParams { max_tokens: 2, ..Default::default() });
        assert_eq!(s.append(3, &[], 100), None);
        assert_eq!(s.append(3, &[], 100), Some(FinishReason::Length));
        let mut s = seq(StopParams { max_tokens: 20, ..Default::default() });
        assert_eq!(s.append(3, &[], 4), Some(FinishReason::Length));
    }

    #[test]
    fn min_tokens_defers_stopping_and_bans_stoppers() {
        let mut s = seq(StopParams { max_tokens: 10, min_tokens: 2, ..Default::default() });
        assert_eq!(s.banned_tokens(&[1]), vec![1]);
        assert_eq!(s.append(1, &[1], 100), None);
        assert_eq!(s.append(1, &[1], 100), None);
        assert!(s.banned_tokens(&[1]).is_empty());
        assert_eq!(s.append(1, &[1], 100), Some(FinishReason::Stop));
        assert_eq!(s.output(), &[1, 1, 1]);
    }

    #[test]
    fn request_validation() {
        let ok = RequestParams::default();
        assert!(ok.validate().is_ok());
        let bad = [
            RequestParams { max_tokens: 0, ..ok.clone() },
            RequestParams { min_tokens: -1, ..ok.clone() },
            RequestParams { top_k: -1, ..ok.clone() },
            RequestParams { top_p: 0.0, ..ok.clone() },
            RequestParams { min_p: -0.5, ..ok.clone() },
            RequestParams { temperature: -1.0, ..ok.clone() },
            RequestParams { repetition_penalty: -1.0, ..ok.clone() },
            RequestParams { stop_token_ids: vec![-3], ..ok.clone() },
            RequestParams { seed: Some(-1), ..ok.clone() },
            RequestParams { seed: Some(1 << 64), ..ok.clone() },
            RequestParams { logprobs: Some(21), ..ok.clone() },
            RequestParams { logprobs: Some(-1), ..ok.clone() },
        ];
        for r in bad {
            let err = r.validate().unwrap_err();
            assert!(!err.is_empty());
        }
    }
}
