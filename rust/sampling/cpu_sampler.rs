//! CPU sampling over a batch of logits rows, rows in parallel.
//!
//! Per row: repetition penalty → frequency/presence penalties → logit bias → temperature
//! → allowed-token mask → top-k → top-p → min-p → a draw from the row's own
//! seeded stream (`random.rs`: Gumbel-max, as the CUDA sampler draws, so a
//! seed gives the same tokens on both). A disallowed token always has
//! probability zero; a row whose mask allows nothing yields token -1 rather
//! than an arbitrary token.


use crate::threads::pool::{self, SendPtr};
use crate::sampling::random::{gumbel, gumbel_bound, Stream};

/// Sampling knobs, validated by [`SamplingParams::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    /// (token, bias) added to the logits before temperature; tokens outside
    /// the vocabulary are ignored.
    pub logit_bias: Vec<(u32, f32)>,
    /// Report log-probabilities with this many top alternatives per token
    /// (see [`top_logprobs`]); None: report none.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !(t >= 0.0 && t.is_finite()) {
            return Err(format!("temperature must be a finite number >= 0, got {t}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r > 0.0 && r.is_finite()) {
            return Err(format!("repetition_penalty must be a finite number > 0, got {r}"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number, got {v}"));
            }
        }
        if let Some((t, b)) = self.logit_bias.iter().find(|(_, b)| !b.is_finite()) {
            return Err(format!("logit_bias for token {t} must be a finite number, got {b}"));
        }
        Ok(())
    }

    /// Whether a draw without the grammar's mask, kept when the grammar
    /// allows its token, is the masked draw: a Gumbel-max over the whole row
    /// (greedy, or temperature alone) picks the same token from any subset
    /// that holds it. Top-k, top-p and min-p cut relative to the row's best,
    /// which the mask moves, and logprobs are the masked row's.
    pub fn mask_can_wait(&self) -> bool {
        self.top_k == 0 && self.top_p == 1.0 && self.min_p == 0.0 && self.logprobs.is_none()
    }

    fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// What one row needs besides its logits.
#[derive(Debug, Clone, Copy)]
pub struct Row<'a> {
    pub params: &'a SamplingParams,
    pub prompt: &'a [u32],
    pub output: &'a [u32],
    /// Tokens that must not be drawn (end tokens before min_tokens).
    pub banned: &'a [u32],
}

/// One draw: the token (-1 when nothing is allowed) and its log-probability
/// under the distribution it was drawn from (after temperature and filters):
/// NaN where the row's params do not ask for logprobs, which nothing then
/// shows (the pass over the vocabulary it takes is skipped).
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: i64,
    pub logprob: f32,
    /// For rows whose params ask for logprobs ([`top_logprobs`]).
    pub top: Option<TopLogprobs>,
}

const NOTHING: Sampled = Sampled { token: -1, logprob: f32::NEG_INFINITY, top: None };

/// Sample one token per row. `logits` is `rows.len() × vocab`, row-major;
/// `mask`, when given, is `rows.len() × mask_words` int32 words, where bit j
/// of word i allows token 32·i + j.
pub fn sample_batch(
    logits: &[f32],
    vocab: usize,
    mask: Option<(&[i32], usize)>,
    rows: &[Row<'_>],
    rngs: &mut [Stream],
) -> Vec<Sampled> {
    let masks: Vec<Option<&[i32]>> = match mask {
        Some((words, w)) => (0..rows.len()).map(|i| Some(&words[i * w..(i + 1) * w])).collect(),
        None => vec![None; rows.len()],
    };
    sample_rows(logits, vocab, &masks, rows, rngs)
}

/// Like [`sample_batch`], with each row's own mask (None: unconstrained, so
/// such a row samples exactly as it would in a batch without masks).
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    masks: &[Option<&[i32]>],
    rows: &[Row<'_>],
    rngs: &mut [Stream],
) -> Vec<Sampled> {
    assert_eq!(logits.len(), rows.len() * vocab, "logits shape");
    assert_eq!(rngs.len(), rows.len(), "one rng per row");
    assert_eq!(masks.len(), rows.len(), "one mask slot per row");
    if vocab == 0 {
        return vec![NOTHING; rows.len()];
    }
    // On the kernels' pool, the caller taking part: its helpers still spin from the forward
    // pass, where rayon's workers had to wake and share the cores with them (a batch-16 step's
    // sampling took 1.2 ms of wall for 0.2 ms of work).
    let mut out = vec![NOTHING; rows.len()];
    let (out_at, rngs_at) = (SendPtr(out.as_mut_ptr()), SendPtr(rngs.as_mut_ptr()));
    pool::run(rows.len(), &|i| {
        // SAFETY: task i alone touches out[i] and rngs[i], both alive until the loop is done
        let (slot, rng) = unsafe { (&mut *out_at.get().add(i), &mut *rngs_at.get().add(i)) };
        *slot = sample_row(&logits[i * vocab..][..vocab], masks[i], &rows[i], rng);
    });
    out
}

pub fn sample_row(logits: &[f32], mask: Option<&[i32]>, row: &Row<'_>, rng: &mut Stream) -> Sampled {
    let step = rng.step;
    rng.step += 1;
    if row.params.is_greedy() && row.params.logprobs.is_none() && only_the_mask_changes(row) {
        return greedy_in_place(logits, mask);
    }
    let x = processed(logits, mask, row);
    let Some(n) = row.params.logprobs else {
        return draw(x, row.params, rng.seed, step);
    };
    let mut s = draw(x.clone(), row.params, rng.seed, step);
    if let Ok(token) = u32::try_from(s.token) {
        s.top = top_logprobs(&x, token, n);
    }
    s
}

/// One draw (the stream's `step`-th) from the processed row.
fn draw(mut x: Vec<f32>, p: &SamplingParams, seed: u64, step: u64) -> Sampled {
    let max = max_of(&x);
    if !usable(max) {
        return NOTHING;
    }
    let wanted = p.logprobs.is_some();
    if p.is_greedy() {
        // First index of the max, like torch.argmax.
        let best = x.iter().position(|&v| v == max).expect("max is in the row");
        let logprob = if wanted { -(sum_exp(&x, max).ln() as f32) } else { f32::NAN };
        return Sampled { token: best as i64, logprob, top: None };
    }
    // Shift by the max before scaling so a tiny temperature cannot overflow;
    // from here on the best logit is 0.
    let inv_t = 1.0 / p.temperature;
    x.iter_mut().for_each(|v| *v = (*v - max) * inv_t);
    if p.top_k > 0 || p.top_p < 1.0 {
        draw_filtered(&x, p, seed, step, wanted)
    } else {
        if p.min_p > 0.0 {
            let floor = p.min_p.ln();
            x.iter_mut().filter(|v| **v < floor).for_each(|v| *v = f32::NEG_INFINITY);
        }
        draw_dense(&mut x, seed, step, wanted)
    }
}

/// Whether [`processed`] would only sanitize the row and apply its mask: no penalty that
/// acts, no logit bias, no banned token.
fn only_the_mask_changes(row: &Row<'_>) -> bool {
    let p = row.params;
    p.repetition_penalty == 1.0
        && ((p.frequency_penalty == 0.0 && p.presence_penalty == 0.0) || row.output.is_empty())
        && p.logit_bias.is_empty()
        && row.banned.is_empty()
}

/// The greedy draw of a row that only its mask changes, and that asks for no logprob: the
/// token `draw` picks from the [`processed`] copy (the first of the largest allowed values,
/// NaN never, +inf as the largest finite value), found in one pass over the logits as they
/// are, a 32-token word of the mask at a time: no copy of the row, no pass to sanitize it.
fn greedy_in_place(logits: &[f32], mask: Option<&[i32]>) -> Sampled {
    let allowed = |i: usize| mask.map_or(u32::MAX, |w| w.get(i).copied().unwrap_or(0) as u32);
    // +inf as the largest finite value; a disallowed token as -inf; NaN stays NaN, which no
    // comparison below lets win
    let value = |word: u32, j: usize, v: f32| if word >> j & 1 == 1 { if v > f32::MAX { f32::MAX } else { v } } else { f32::NEG_INFINITY };
    let (mut best, mut at) = (f32::NEG_INFINITY, 0);
    for (i, chunk) in logits.chunks(32).enumerate() {
        let word = allowed(i);
        if word == 0 {
            continue;
        }
        let m = chunk.iter().enumerate().fold(f32::NEG_INFINITY, |m, (j, &v)| {
            let v = value(word, j, v);
            if v > m { v } else { m }
        });
        if m > best {
            (best, at) = (m, i);
        }
    }
    if !usable(best) {
        return NOTHING;
    }
    let word = allowed(at);
    let j = logits[at * 32..].iter().take(32).enumerate().position(|(j, &v)| value(word, j, v) == best).expect("the max is in its word");
    Sampled { token: (at * 32 + j) as i64, logprob: f32::NAN, top: None }
}

/// The logits after penalties, logit bias, banned tokens and the mask:
/// what temperature and the top-k/p/min-p filters then work on.
fn processed(logits: &[f32], mask: Option<&[i32]>, row: &Row<'_>) -> Vec<f32> {
    let mut x = logits.to_vec();
    sanitize(&mut x);
    let p = row.params;
    apply_repetition_penalty(&mut x, row.prompt, row.output, p.repetition_penalty);
    apply_frequency_presence(&mut x, row.output, p.frequency_penalty, p.presence_penalty);
    for &(t, b) in &p.logit_bias {
        if let Some(v) = x.get_mut(t as usize) {
            *v += b;
        }
    }
    ban(&mut x, row.banned);
    if let Some(words) = mask {
        apply_mask(&mut x, words);
    }
    x
}

/// A token's log-probability and the `n` most likely tokens with theirs.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprobs {
    pub logprob: f32,
    /// Most likely first; ties by lower token id. Disallowed tokens never
    /// appear, so fewer than `n` where the mask allows fewer.
    pub top: Vec<(u32, f32)>,
}

/// Log-probabilities as a client reads them (OpenAI's `logprobs`): under the
/// distribution of the [`processed`] logits `x`, i.e. after penalties, logit
/// bias and the grammar mask, before temperature and the top-k/p/min-p
/// filters. Greedy decoding therefore always picks the first of `top`.
/// None when the row allows nothing.
fn top_logprobs(x: &[f32], token: u32, n: usize) -> Option<TopLogprobs> {
    let max = max_of(&x);
    if !usable(max) {
        return None;
    }
    let lse = max + sum_exp(&x, max).ln() as f32;
    let lp = |t: u32| x.get(t as usize).map_or(f32::NEG_INFINITY, |&v| v - lse);
    let mut cands: Vec<(f32, u32)> = x.iter().enumerate().filter(|(_, v)| usable(**v)).map(|(i, &v)| (v, i as u32)).collect();
    let n = n.min(cands.len());
    if n > 0 && n < cands.len() {
        cands.select_nth_unstable_by(n - 1, better);
    }
    cands.truncate(n);
    cands.sort_unstable_by(better);
    Some(TopLogprobs { logprob: lp(token), top: cands.into_iter().map(|(_, t)| (t, lp(t))).collect() })
}

/// NaN never wins and is never drawn; +inf becomes the largest finite value
/// so that shifting by the max stays defined.
fn sanitize(x: &mut [f32]) {
    for v in x.iter_mut() {
        if v.is_nan() {
            *v = f32::NEG_INFINITY;
        } else if *v == f32::INFINITY {
            *v = f32::MAX;
        }
    }
}

/// HF semantics: every token seen in prompt or output, once.
fn apply_repetition_penalty(x: &mut [f32], prompt: &[u32], output: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen: Vec<u32> = prompt.iter().chain(output).copied().filter(|&t| (t as usize) < x.len()).collect();
    seen.sort_unstable();
    seen.dedup();
    for t in seen {
        let v = &mut x[t as usize];
        *v = if *v > 0.0 { *v / penalty } else { *v * penalty };
    }
}

/// OpenAI semantics over output tokens: minus frequency × count, minus
/// presence once if the token occurred at all.
fn apply_frequency_presence(x: &mut [f32], output: &[u32], frequency: f32, presence: f32) {
    if (frequency == 0.0 && presence == 0.0) || output.is_empty() {
        return;
    }
    let mut sorted: Vec<u32> = output.iter().copied().filter(|&t| (t as usize) < x.len()).collect();
    sorted.sort_unstable();
    for run in sorted.chunk_by(|a, b| a == b) {
        x[run[0] as usize] -= frequency * run.len() as f32 + presence;
    }
}

fn ban(x: &mut [f32], banned: &[u32]) {
    for &t in banned {
        if let Some(v) = x.get_mut(t as usize) {
            *v = f32::NEG_INFINITY;
        }
    }
}

/// Tokens beyond the mask's words are disallowed.
fn apply_mask(x: &mut [f32], words: &[i32]) {
    for (i, chunk) in x.chunks_mut(32).enumerate() {
        let word = words.get(i).copied().unwrap_or(0) as u32;
        if word == u32::MAX {
            continue;
        }
        for (j, v) in chunk.iter_mut().enumerate() {
            if word & (1 << j) == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}

fn usable(v: f32) -> bool {
    v > f32::NEG_INFINITY // false for NaN too
}

// ---- vectorisable kernels ------------------------------------------------
// Rows are up to ~150k wide; these loops keep 16 independent lanes so the
// compiler can use SIMD without reassociating a single float reduction.

const LANES: usize = 16;

fn max_of(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let tail = chunks.remainder().iter().copied();
    acc.into_iter().chain(tail).fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

/// Σ e^(v − shift) over the row, for `shift` ≥ every v.
fn sum_exp(x: &[f32], shift: f32) -> f64 {
    x.chunks(4096).map(|c| lane_sum(c, |v| exp_le0(v - shift))).sum()
}

fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut acc = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            acc[j] += f(c[j]);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(f(v))).sum();
    acc.iter().map(|&a| f64::from(a)).sum::<f64>() + tail
}

/// e^x for x ≤ 0, exactly 0 for x ≤ −87 (so −inf has probability zero);
/// relative error about 1e-7. Cody–Waite reduction x = n·ln2 + r, |r| ≤ ln2/2,
/// and a degree-6 polynomial for e^r: branch-free so that loops vectorise.
#[inline(always)]
fn exp_le0(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_145_75; // exact in f32, so n · LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    let xc = if x > -87.0 { x } else { -87.0 };
    let k = xc * std::f32::consts::LOG2_E + MAGIC;
    let n = k - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    let n_int = k.to_bits() as i32 - MAGIC.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) << 23) as u32);
    if x > -87.0 { scale * p } else { 0.0 }
}

/// Candidates sorted best first: higher logit, then lower token id, so the
/// order (and hence every draw) is fully determined by the logits.
fn better(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The Gumbel-max pick among `(scaled logit ≤ 0, token)` candidates: the
/// largest `s + gumbel(seed, step, token)`, the first on a tie, as the CUDA
/// sampler picks. A candidate whose `s` plus the largest Gumbel cannot beat
/// the best key so far is skipped unhashed; the row's best (s = 0) goes
/// first, so most of a vocabulary is skipped.
fn gumbel_max(cands: impl Iterator<Item = (f32, u32)> + Clone, seed: u64, step: u64) -> Option<u32> {
    let bound = gumbel_bound();
    let first = cands.clone().find(|c| c.0 == 0.0)?;
    let (mut key, mut pick) = (gumbel(seed, step, first.1), first.1);
    for (s, t) in cands {
        if s + bound < key || t == first.1 {
            continue;
        }
        let k = s + gumbel(seed, step, t);
        if k > key || (k == key && t < pick) {
            (key, pick) = (k, t);
        }
    }
    Some(pick)
}

/// A draw over the whole row (no top-k/top-p): Gumbel-max over the usable
/// tokens, and the log-probability from the row's weights where `wanted`.
fn draw_dense(x: &mut [f32], seed: u64, step: u64, wanted: bool) -> Sampled {
    let usable = x.iter().enumerate().filter(|c| *c.1 > f32::NEG_INFINITY).map(|(i, &v)| (v, i as u32));
    let pick = gumbel_max(usable, seed, step).expect("the max is usable") as usize;
    if !wanted {
        return Sampled { token: pick as i64, logprob: f32::NAN, top: None };
    }
    let best = x[pick];
    x.iter_mut().for_each(|v| *v = exp_le0(*v));
    let total = lane_sum(x, |w| w);
    Sampled { token: pick as i64, logprob: (f64::from(exp_le0(best)) / total).ln() as f32, top: None }
}

/// Top-k → top-p → min-p over an explicit candidate list, then one draw.
fn draw_filtered(x: &[f32], p: &SamplingParams, seed: u64, step: u64, wanted: bool) -> Sampled {
    let mut cands = if p.top_k > 0 {
        let top = keep_top_k(likely_top(x, p.top_k).into_iter(), p.top_k);
        keep_nucleus(top.into_iter(), p.top_p, None)
    } else {
        likely_nucleus(x, p.top_p)
    };
    if p.min_p > 0.0 {
        // p_i >= min_p · p_max  <=>  logit_i >= ln(min_p), the best logit being 0
        let floor = p.min_p.ln();
        cands.retain(|c| c.0 >= floor);
    }
    let pick = gumbel_max(cands.iter().copied(), seed, step).expect("the max is kept");
    if !wanted {
        return Sampled { token: i64::from(pick), logprob: f32::NAN, top: None };
    }
    let total: f64 = cands.iter().map(|c| f64::from(exp_le0(c.0))).sum();
    let s = cands.iter().find(|c| c.1 == pick).expect("picked among them").0;
    Sampled { token: i64::from(pick), logprob: (f64::from(exp_le0(s)) / total).ln() as f32, top: None }
}

// Top-k and top-p need the best candidates in order, but sorting a whole
// vocabulary per row is slow. Candidates are first bucketed by logit (the
// best logit is 0, and below -87 a weight is 0); only the one bucket where
// the cut falls is sorted, every better bucket being kept whole.

const BINS: usize = 4096;
const BIN_SCALE: f32 = BINS as f32 / 88.0;

/// Bucket of a logit ≤ 0: 0 holds the best, BINS - 1 everything ≤ -87.
fn bin(logit: f32) -> usize {
    let b = -logit * BIN_SCALE;
    if b < (BINS - 1) as f32 { b.max(0.0) as usize } else { BINS - 1 }
}

/// The usable tokens at or above `floor`.
fn at_least(x: &[f32], floor: f32) -> Vec<(f32, u32)> {
    x.iter().enumerate().filter(|(_, v)| **v >= floor && usable(**v)).map(|(i, &v)| (v, i as u32)).collect()
}

/// A superset of the row's k best tokens, usually not much bigger: the
/// threshold is guessed from a strided sample of the row, with a margin, and
/// dropped if it leaves fewer than k.
fn likely_top(x: &[f32], k: usize) -> Vec<(f32, u32)> {
    let step = (x.len() / 2048).max(1);
    let mut sample: Vec<f32> = x.iter().step_by(step).copied().filter(|v| usable(*v)).collect();
    let want = k.div_ceil(step) * 2 + 8;
    if want < sample.len() {
        sample.select_nth_unstable_by(want, |a, b| b.total_cmp(a));
        let cands = at_least(x, sample[want]);
        if cands.len() >= k {
            return cands;
        }
    }
    at_least(x, f32::NEG_INFINITY)
}

/// The row's top-p nucleus (the best logit being 0). Tokens each below a
/// fraction (1 - top_p) / n of the total weight together hold less than
/// 1 - top_p of it, so the nucleus, best first, ends before any: only the
/// rest need bucketing.
fn likely_nucleus(x: &[f32], top_p: f32) -> Vec<(f32, u32)> {
    let total = sum_exp(x, 0.0);
    let floor = (f64::from(1.0 - top_p) * total / x.len() as f64).ln() as f32;
    let cands = at_least(x, floor - 1e-3); // slack for rounding: a bigger superset is fine
    keep_nucleus(cands.into_iter(), top_p, Some(total))
}

/// The candidates of buckets before `cut` (in row order), then those of
/// bucket `cut` sorted best first; the rest are dropped. Also returns how
/// many come before bucket `cut`.
fn split_at_bin<I>(cands: I, cut: usize) -> (Vec<(f32, u32)>, usize)
where
    I: Iterator<Item = (f32, u32)>,
{
    let mut kept = Vec::new();
    let mut in_cut = Vec::new();
    for c in cands {
        match bin(c.0).cmp(&cut) {
            std::cmp::Ordering::Less => kept.push(c),
            std::cmp::Ordering::Equal => in_cut.push(c),
            std::cmp::Ordering::Greater => {}
        }
    }
    in_cut.sort_unstable_by(better);
    let before = kept.len();
    kept.extend(in_cut);
    (kept, before)
}

/// The k best candidates (ties at the cut broken by lower token id).
fn keep_top_k<I>(cands: I, k: usize) -> Vec<(f32, u32)>
where
    I: Iterator<Item = (f32, u32)> + Clone,
{
    let mut counts = vec![0usize; BINS];
    for c in cands.clone() {
        counts[bin(c.0)] += 1;
    }
    let mut seen = 0;
    let Some(cut) = counts.iter().position(|&n| {
        seen += n;
        seen >= k
    }) else {
        return cands.collect(); // fewer than k
    };
    let (mut kept, _) = split_at_bin(cands, cut);
    kept.truncate(k);
    kept
}

/// The smallest best-first set of candidates whose probability reaches
/// `top_p` (in no particular order). `total` is the weight of the whole
/// distribution when `cands` leaves out some of it.
fn keep_nucleus<I>(cands: I, top_p: f32, total: Option<f64>) -> Vec<(f32, u32)>
where
    I: Iterator<Item = (f32, u32)> + Clone,
{
    if top_p >= 1.0 {
        return cands.collect();
    }
    let mut mass = vec![0f64; BINS];
    for c in cands.clone() {
        mass[bin(c.0)] += f64::from(exp_le0(c.0));
    }
    let total = total.unwrap_or_else(|| mass.iter().sum());
    let need = f64::from(top_p) * total;
    let mut acc = 0.0;
    let Some(cut) = mass.iter().position(|&m| {
        acc += m;
        acc >= need
    }) else {
        return cands.collect(); // rounding: keep everything
    };
    let mut acc: f64 = mass[..cut].iter().sum();
    let (mut kept, start) = split_at_bin(cands, cut);
    for i in start..kept.len() {
        acc += f64::from(exp_le0(kept[i].0));
        if acc >= need {
            kept.truncate(i + 1);
            break;
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Test data, reproducible.
    pub(super) struct Numbers(pub u64);

    impl Numbers {
        pub fn next_u32(&mut self) -> u32 {
            self.0 += 1;
            (crate::sampling::random::mix64(self.0) >> 32) as u32
        }
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..Default::default() }
    }

    /// ... asking for the sampled token's logprob (no alternatives)
    fn with_logprob(temperature: f32) -> SamplingParams {
        SamplingParams { logprobs: Some(0), ..params(temperature) }
    }

    fn one(logits: &[f32], p: &SamplingParams, mask: Option<&[i32]>, seed: u64) -> Sampled {
        let row = Row { params: p, prompt: &[], output: &[], banned: &[] };
        sample_row(logits, mask, &row, &mut Stream::new(Some(seed)))
    }

    fn hist(logits: &[f32], p: &SamplingParams, n: usize, seed: u64) -> Vec<usize> {
        let row = Row { params: p, prompt: &[], output: &[], banned: &[] };
        let mut rng = Stream::new(Some(seed));
        let mut counts = vec![0; logits.len()];
        for _ in 0..n {
            counts[sample_row(logits, None, &row, &mut rng).token as usize] += 1;
        }
        counts
    }

    const LOGITS: [f32; 6] = [1.0, 3.0, 2.5, 3.0, -1.0, 0.0];

    #[test]
    fn greedy_takes_first_max_and_reports_logprob() {
        let s = one(&LOGITS, &with_logprob(0.0), None, 0);
        assert_eq!(s.token, 1);
        let lse = LOGITS.iter().map(|v| v.exp()).sum::<f32>().ln();
        assert!((s.logprob - (3.0 - lse)).abs() < 1e-5);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        for seed in 0..20 {
            let k1 = SamplingParams { top_k: 1, ..params(1.0) };
            assert_eq!(one(&LOGITS, &k1, None, seed).token, 1);
            let p0 = SamplingParams { top_p: 1e-6, ..with_logprob(1.0) };
            let s = one(&LOGITS, &p0, None, seed);
            assert_eq!(s.token, 1);
            assert_eq!(s.logprob, 0.0, "only one candidate left");
        }
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let p = SamplingParams { top_k: 3, ..params(1.0) };
        let h = hist(&LOGITS, &p, 3000, 1);
        assert_eq!(h[0] + h[4] + h[5], 0);
        assert!(h[1] > 0 && h[2] > 0 && h[3] > 0);
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps the first two.
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let p = SamplingParams { top_p: 0.75, ..params(1.0) };
        let h = hist(&logits, &p, 4000, 2);
        assert_eq!(h[2] + h[3], 0);
        assert!(h[0] > h[1] && h[1] > 0);
        // A long tail exercises the partial sort's doubling.
        let mut long = vec![-5.0f32; 1000];
        long[700] = 5.0;
        let p = SamplingParams { top_p: 0.999, ..params(1.0) };
        let h = hist(&long, &p, 2000, 3);
        assert!(h[700] > 0 && h.iter().sum::<usize>() == 2000);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // Probabilities 0.6, 0.3, 0.1: min_p 0.4 keeps p >= 0.24.
        let logits: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
        let p = SamplingParams { min_p: 0.4, ..params(1.0) };
        let h = hist(&logits, &p, 3000, 4);
        assert_eq!(h[2], 0);
        assert!(h[1] > 0);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut x = vec![2.0, -2.0, 2.0];
        apply_repetition_penalty(&mut x, &[0, 1], &[1, 1], 2.0);
        assert_eq!(x, vec![1.0, -4.0, 2.0]);
    }

    #[test]
    fn frequency_and_presence_follow_openai() {
        let mut x = vec![0.0; 4];
        apply_frequency_presence(&mut x, &[2, 2, 3], 0.5, 1.0);
        assert_eq!(x, vec![0.0, 0.0, -2.0, -1.5]);
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let p = SamplingParams { repetition_penalty: 4.0, ..params(0.0) };
        let row = Row { params: &p, prompt: &[1], output: &[3], banned: &[] };
        let s = sample_row(&LOGITS, None, &row, &mut Stream::new(Some(0)));
        assert_eq!(s.token, 2);
    }

    #[test]
    fn mask_is_hard() {
        let mask = [0b100100]; // tokens 2 and 5
        assert_eq!(one(&LOGITS, &params(0.0), Some(&mask), 0).token, 2);
        for seed in 0..50 {
            let t = one(&LOGITS, &params(1.5), Some(&mask), seed).token;
            assert!(t == 2 || t == 5);
        }
        let none = [0];
        assert_eq!(one(&LOGITS, &params(0.0), Some(&none), 0), NOTHING);
        assert_eq!(one(&LOGITS, &params(1.0), Some(&none), 0).token, -1);
    }

    #[test]
    fn mask_spans_words() {
        let mut logits = vec![0.0f32; 70];
        logits[3] = 9.0;
        let mut words = [0i32; 3];
        words[2] = 1 << 5; // token 69
        assert_eq!(one(&logits, &params(0.0), Some(&words), 0).token, 69);
        words[0] = -1; // all 32 tokens of word 0, sign bit included
        assert_eq!(one(&logits, &params(0.0), Some(&words), 0).token, 3);
    }

    #[test]
    fn logit_bias_shifts_before_the_mask() {
        let p = SamplingParams { logit_bias: vec![(4, 10.0), (99, 5.0)], ..params(0.0) };
        assert_eq!(one(&LOGITS, &p, None, 0).token, 4);
        // The mask still wins over any bias.
        assert_eq!(one(&LOGITS, &p, Some(&[0b100]), 0).token, 2);
        let bad = SamplingParams { logit_bias: vec![(1, f32::NAN)], ..params(0.0) };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn banned_tokens_are_never_drawn() {
        let p = params(0.0);
        let row = Row { params: &p, prompt: &[], output: &[], banned: &[1, 3] };
        assert_eq!(sample_row(&LOGITS, None, &row, &mut Stream::new(Some(0))).token, 2);
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = params(1.0);
        let a = hist(&LOGITS, &p, 1, 42);
        let b = hist(&LOGITS, &p, 1, 42);
        assert_eq!(a, b);
        let draws = |seed| {
            let row = Row { params: &p, prompt: &[], output: &[], banned: &[] };
            let mut rng = Stream::new(Some(seed));
            (0..50).map(|_| sample_row(&LOGITS, None, &row, &mut rng).token).collect::<Vec<_>>()
        };
        assert_eq!(draws(7), draws(7));
        assert_ne!(draws(7), draws(8));
    }

    #[test]
    fn batch_matches_rows_and_masks_per_row() {
        let p = with_logprob(1.0);
        let rows = [Row { params: &p, prompt: &[], output: &[], banned: &[] }; 3];
        let logits: Vec<f32> = LOGITS.iter().cycle().take(18).copied().collect();
        let mask = [1 << 0, 1 << 4, 1 << 5];
        let mut rngs: Vec<Stream> = (0..3).map(|s| Stream::new(Some(s))).collect();
        let out = sample_batch(&logits, 6, Some((&mask, 1)), &rows, &mut rngs);
        let tokens: Vec<i64> = out.iter().map(|s| s.token).collect();
        assert_eq!(tokens, vec![0, 4, 5]);
        assert!(out.iter().all(|s| s.logprob == 0.0));
    }

    #[test]
    fn temperature_one_matches_the_distribution() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let n = 20_000;
        let h = hist(&logits, &params(1.0), n, 1234);
        let chi2: f64 = h
            .iter()
            .zip(probs)
            .map(|(&o, p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum();
        // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
        assert!(chi2 < 16.27, "chi2 = {chi2}, counts {h:?}");
    }

    #[test]
    fn top_logprobs_follow_the_masked_distribution() {
        let logits = [1.0, 3.0, 2.0, 0.5];
        let p = SamplingParams { logprobs: Some(2), ..params(0.0) };
        let mask = [0b1101]; // token 1, the overall best, is disallowed
        let s = one(&logits, &p, Some(&mask), 0);
        assert_eq!(s.token, 2);
        let t = s.top.expect("asked for logprobs");
        let lse = (1f32.exp() + 2f32.exp() + 0.5f32.exp()).ln();
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 0]);
        assert!((t.logprob - (2.0 - lse)).abs() < 1e-5 && (t.top[0].1 - t.logprob).abs() < 1e-7);
        assert!((t.top[1].1 - (1.0 - lse)).abs() < 1e-5);
        let wide = SamplingParams { logprobs: Some(20), ..params(1.0) };
        let t = one(&logits, &wide, Some(&mask), 3).top.unwrap();
        assert_eq!(t.top.len(), 3, "only allowed tokens are listed");
        assert!(one(&logits, &params(0.0), None, 0).top.is_none());
    }

    #[test]
    fn sampled_logprob_is_under_the_filtered_distribution() {
        let logits: Vec<f32> = [0.5f32, 0.5].iter().map(|p| p.ln()).collect();
        let s = one(&logits, &with_logprob(1.0), None, 0);
        assert!((s.logprob - 0.5f32.ln()).abs() < 1e-6);
    }

    /// The greedy pass over the logits as they are picks what the processed copy's argmax
    /// picks: rows of NaN, ±inf, ties and repeated values, masks of every density, masks
    /// shorter than the row, and a row that allows nothing.
    #[test]
    fn greedy_in_place_is_the_processed_rows_argmax() {
        let mut numbers = Numbers(5);
        let silent = params(0.0);
        let row = Row { params: &silent, prompt: &[], output: &[], banned: &[] };
        for case in 0..400 {
            let n = 1 + (numbers.next_u32() % 300) as usize;
            let logits: Vec<f32> = (0..n)
                .map(|_| match numbers.next_u32() % 20 {
                    0 => f32::NAN,
                    1 => f32::INFINITY,
                    2 => f32::NEG_INFINITY,
                    3 => f32::MAX,
                    k => (k % 7) as f32 - 3.0 + (numbers.next_u32() % 4) as f32 / 8.0,
                })
                .collect();
            let words = n.div_ceil(32) - (case % 3 == 0) as usize;   // sometimes a word short
            let density = case % 5;
            let mask: Vec<i32> = (0..words)
                .map(|_| (0..density).fold(u32::MAX, |w, _| w & numbers.next_u32()) as i32)
                .collect();
            for m in [None, Some(&mask[..])] {
                let x = processed(&logits, m, &row);
                let max = max_of(&x);
                let want = if usable(max) { x.iter().position(|&v| v == max).unwrap() as i64 } else { -1 };
                assert_eq!(greedy_in_place(&logits, m).token, want, "case {case}, mask {}", m.is_some());
            }
        }
    }

    /// A row that does not ask for logprobs draws the same tokens, and its logprob is NaN
    /// (the pass over the vocabulary that computes it is skipped).
    #[test]
    fn a_row_not_asking_draws_the_same_tokens_without_a_logprob() {
        let mut numbers = Numbers(11);
        let logits: Vec<f32> = (0..3000).map(|_| (numbers.next_u32() % 10_000) as f32 / 900.0).collect();
        let mask: Vec<i32> = (0..logits.len().div_ceil(32)).map(|_| numbers.next_u32() as i32).collect();
        let knobs = [(0.0, 0, 1.0, 0.0), (0.9, 0, 1.0, 0.0), (1.2, 0, 1.0, 0.1), (1.0, 50, 1.0, 0.0), (0.7, 0, 0.8, 0.0)];
        for (t, top_k, top_p, min_p) in knobs {
            let silent = SamplingParams { temperature: t, top_k, top_p, min_p, ..Default::default() };
            let asking = SamplingParams { logprobs: Some(0), ..silent.clone() };
            for seed in 0..20 {
                let (a, b) = (one(&logits, &silent, Some(&mask), seed), one(&logits, &asking, Some(&mask), seed));
                assert_eq!(a.token, b.token, "t={t} k={top_k} p={top_p}");
                assert!(a.logprob.is_nan() && a.top.is_none() && b.logprob.is_finite() && b.logprob <= 0.0);
            }
        }
    }

    #[test]
    fn fast_exp_is_accurate_and_zero_for_minus_inf() {
        for i in 0..8700 {
            let x = -(i as f32) / 100.0;
            let (got, want) = (exp_le0(x), f64::from(x).exp());
            assert!(((f64::from(got) - want) / want).abs() < 3e-7, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_le0(-100.0), 0.0);
        assert_eq!(exp_le0(0.0), 1.0);
    }

    #[test]
    fn nan_and_inf_logits_do_not_break_rows() {
        let logits = [f32::NAN, 1.0, f32::INFINITY, 0.5];
        assert_eq!(one(&logits, &params(0.0), None, 0).token, 2);
        assert_eq!(one(&logits, &params(1.0), None, 0).token, 2);
        let all_nan = [f32::NAN; 3];
        assert_eq!(one(&all_nan, &params(1.0), None, 0).token, -1);
    }

    #[test]
    fn wide_rows_use_every_block() {
        // 5000 equally likely tokens spread over several 1024-wide blocks.
        let logits = vec![0.0f32; 5000];
        let h = hist(&logits, &params(1.0), 20_000, 9);
        let late = h[4096..].iter().sum::<usize>();
        assert!(late > 3000 && late < 4600, "{late}");
    }

    #[test]
    fn bucketed_top_k_and_top_p_match_a_full_sort() {
        let mut rng = Numbers(5);
        for case in 0..200 {
            let n = 1 + (rng.next_u32() % 3000) as usize;
            let spread = [0.01f32, 1.0, 30.0][case % 3];
            let logits: Vec<f32> = (0..n).map(|_| -((rng.next_u32() % 1000) as f32) * spread / 100.0).collect();
            let mut sorted: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &v)| (v, i as u32)).collect();
            sorted.sort_by(better);
            let k = 1 + (rng.next_u32() as usize % n);
            let row = logits.iter().enumerate().map(|(i, &v)| (v, i as u32));
            let cands = keep_top_k(row.clone(), k);
            let mut got: Vec<u32> = cands.iter().map(|c| c.1).collect();
            let mut want: Vec<u32> = sorted[..k].iter().map(|c| c.1).collect();
            got.sort();
            want.sort();
            assert_eq!(got, want, "top-k {k} of {n}");
            // The prefilter only drops what cannot be kept.
            let mut fast: Vec<u32> = keep_top_k(likely_top(&logits, k).into_iter(), k).iter().map(|c| c.1).collect();
            fast.sort();
            assert_eq!(fast, want, "prefiltered top-k {k} of {n}");
            let top_p = (rng.next_u32() % 1000) as f32 / 1000.0 + 0.0005;
            let cands = keep_nucleus(row, top_p, None);
            let total: f64 = sorted.iter().map(|c| f64::from(exp_le0(c.0))).sum();
            let mut acc = 0.0;
            let want = 1 + sorted.iter().position(|c| {
                acc += f64::from(exp_le0(c.0));
                acc >= f64::from(top_p) * total
            }).unwrap_or(n - 1);
            let mut fast: Vec<u32> = likely_nucleus(&logits, top_p).iter().map(|c| c.1).collect();
            let mut slow: Vec<u32> = cands.iter().map(|c| c.1).collect();
            fast.sort();
            slow.sort();
            assert_eq!(fast, slow, "prefiltered top-p {top_p}");
            // Summation order may move a borderline token by one.
            assert!(cands.len().abs_diff(want) <= 1, "top-p {top_p}: {} vs {want}", cands.len());
            // Kept: a best-first prefix (in any order).
            let mut kept: Vec<u32> = cands.iter().map(|c| c.1).collect();
            let mut prefix: Vec<u32> = sorted[..kept.len()].iter().map(|c| c.1).collect();
            kept.sort();
            prefix.sort();
            assert_eq!(kept, prefix);
        }
    }

    #[test]
    fn validation_rejects_bad_params() {
        let bad = [
            SamplingParams { temperature: -0.1, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams { top_p: 0.0, ..Default::default() },
            SamplingParams { top_p: 1.5, ..Default::default() },
            SamplingParams { min_p: 1.5, ..Default::default() },
            SamplingParams { repetition_penalty: 0.0, ..Default::default() },
            SamplingParams { presence_penalty: f32::INFINITY, ..Default::default() },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?}");
        }
        assert!(SamplingParams::default().validate().is_ok());
    }
}

#[cfg(test)]
mod timing {
    use super::tests::Numbers;
    use super::*;

    /// `cargo test --release -- --ignored --nocapture sampling_speed`
    #[test]
    #[ignore]
    fn sampling_speed() {
        let v = 152_064;
        let mut numbers = Numbers(1);
        let mut rng = Stream::new(Some(1));
        let logits: Vec<f32> = (0..v).map(|i| (numbers.next_u32() % 1000) as f32 / 100.0 + if i < 50 { 15.0 } else { 0.0 }).collect();
        let cases = [
            ("greedy", SamplingParams::default()),
            ("temp", SamplingParams { temperature: 0.7, ..Default::default() }),
            ("top_p", SamplingParams { temperature: 0.7, top_p: 0.9, ..Default::default() }),
            ("top_k", SamplingParams { temperature: 0.7, top_k: 50, ..Default::default() }),
            ("min_p", SamplingParams { temperature: 0.7, min_p: 0.05, ..Default::default() }),
        ];
        for (name, p) in cases {
            let row = Row { params: &p, prompt: &[], output: &[], banned: &[] };
            let t = std::time::Instant::now();
            for _ in 0..50 {
                std::hint::black_box(sample_row(&logits, None, &row, &mut rng));
            }
            println!("{name:8} {:7.1} us/row", t.elapsed().as_secs_f64() / 50.0 * 1e6);
        }
    }
}
