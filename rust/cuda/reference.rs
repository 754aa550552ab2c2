//! The algorithms of the CUDA kernels in `cuda/`, on the CPU, pass for pass:
//! the decode attention over the paged KV cache and the mask-fused sampler.
//! They are tested against torch (tests/model/test_cuda_kernels.py) so the
//! algorithm is checked where no GPU is; on a GPU the kernels are checked
//! against these and against torch. The argument checks here are the
//! launchers' too (rust/cuda/launchers.rs): one place says what a valid call is.
//!
//! The sampler's random numbers are the one stream both samplers draw from
//! (`sampling/random.rs`: a hash of seed, step and token), so a seeded draw here
//! picks what the GPU picks, up to the last bit of an `exp` or `ln` at a tie.

use crate::cpu::cpu_attention::Layout;
use crate::sampling::random::gumbel;

/// Positions are split over this many partitions (the kernel's warps), each
/// with its own online softmax, merged at the end.
pub const WARPS: usize = 4;
/// Head sizes the decode kernel is built for.
pub const HEAD_SIZES: [usize; 3] = [64, 128, 256];

/// How a layer's decode scores q·k become weights: the scale, then what
/// the new architectures add. `S` is how the sinks are held: a slice here,
/// a device pointer for the launcher.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeScores<S> {
    pub scale: f32,
    /// Only the last `window` positions are read (0: all of them).
    pub window: usize,
    /// Scores become softcap · tanh(s / softcap) (0: no cap).
    pub softcap: f32,
    /// Per head, a logit that joins the softmax without a value.
    pub sinks: Option<S>,
}

impl<S> DecodeScores<S> {
    pub fn plain(scale: f32) -> Self {
        DecodeScores { scale, window: 0, softcap: 0.0, sinks: None }
    }

    pub fn check(&self) -> Result<(), String> {
        if !self.scale.is_finite() {
            return Err(format!("scale must be finite, got {}", self.scale));
        }
        if !(self.softcap >= 0.0 && self.softcap.is_finite()) {
            return Err(format!("softcap must be a finite number >= 0 (0: none), got {}", self.softcap));
        }
        Ok(())
    }
}

/// The sizes of one decode-attention call: one query row per sequence, over
/// the paged cache's [`Layout`] (whose fields it reads as its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeShape {
    pub seqs: usize,
    pub paged: Layout,
}

impl std::ops::Deref for DecodeShape {
    type Target = Layout;

    fn deref(&self) -> &Layout {
        &self.paged
    }
}

impl DecodeShape {
    pub fn check(&self) -> Result<(), String> {
        if self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return Err(format!("heads ({}) must be a multiple of kv_heads ({})", self.heads, self.kv_heads));
        }
        if !HEAD_SIZES.contains(&self.head_size) {
            return Err(format!("head size {} is not one the kernel is built for ({HEAD_SIZES:?})", self.head_size));
        }
        if self.block_size == 0 || self.max_blocks == 0 {
            return Err("block_size and the block table's width must be positive".into());
        }
        Ok(())
    }

    /// The block tables and context lengths name only blocks that exist and
    /// fit the table (what the kernel reads without checking).
    pub fn check_tables(&self, block_tables: &[i32], context_lens: &[i32]) -> Result<(), String> {
        if block_tables.len() != self.seqs * self.max_blocks || context_lens.len() != self.seqs {
            return Err(format!(
                "block_tables must be [{}, {}] and context_lens [{}]",
                self.seqs, self.max_blocks, self.seqs
            ));
        }
        for (s, &len) in context_lens.iter().enumerate() {
            let len = usize::try_from(len).map_err(|_| format!("context_lens[{s}] is negative"))?;
            if len > self.max_blocks * self.block_size {
                return Err(format!("context_lens[{s}] = {len} is longer than the block table holds"));
            }
            let used = len.div_ceil(self.block_size);
            let row = &block_tables[s * self.max_blocks..s * self.max_blocks + used];
            if let Some(b) = row.iter().find(|&&b| b < 0 || b as usize >= self.num_blocks) {
                return Err(format!("block_tables[{s}] names block {b}, outside 0..{}", self.num_blocks));
            }
        }
        Ok(())
    }
}

/// Decode attention: `q` [seqs, heads, head], caches [blocks, block_size,
/// kv_heads, head], scores as `scores` says; returns [seqs, heads, head].
/// A sequence with no context gets zeros.
pub fn paged_decode(
    shape: &DecodeShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_tables: &[i32],
    context_lens: &[i32],
    scores: &DecodeScores<&[f32]>,
) -> Result<Vec<f32>, String> {
    shape.check()?;
    scores.check()?;
    shape.check_tables(block_tables, context_lens)?;
    if scores.sinks.is_some_and(|s| s.len() != shape.heads) {
        return Err(format!("sinks must have one logit per head ({})", shape.heads));
    }
    let scale = scores.scale;
    let d = shape.head_size;
    let cache_len = shape.num_blocks * shape.block_size * shape.kv_heads * d;
    if q.len() != shape.seqs * shape.heads * d || k_cache.len() != cache_len || v_cache.len() != cache_len {
        return Err("q or the caches do not have the shapes given".into());
    }
    let group = shape.heads / shape.kv_heads;
    let mut out = vec![0f32; q.len()];
    for s in 0..shape.seqs {
        let table = &block_tables[s * shape.max_blocks..];
        let len = context_lens[s] as usize;
        let start = if scores.window > 0 { len.saturating_sub(scores.window) } else { 0 };
        for h in 0..shape.heads {
            let qrow: Vec<f32> = q[(s * shape.heads + h) * d..][..d].iter().map(|v| v * scale).collect();
            let row_of = |pos: usize| {
                let block = table[pos / shape.block_size] as usize;
                ((block * shape.block_size + pos % shape.block_size) * shape.kv_heads + h / group) * d
            };
            // each partition's running max, sum and weighted values
            let mut parts: [(f32, f32, Vec<f32>); WARPS] =
                std::array::from_fn(|_| (f32::NEG_INFINITY, 0.0, vec![0.0; d]));
            for (w, (m, l, acc)) in parts.iter_mut().enumerate() {
                for pos in (start + w..len).step_by(WARPS) {
                    let at = row_of(pos);
                    let mut score: f32 = qrow.iter().zip(&k_cache[at..at + d]).map(|(a, b)| a * b).sum();
                    if scores.softcap > 0.0 {
                        score = scores.softcap * (score / scores.softcap).tanh();
                    }
                    let m_new = m.max(score);
                    let (shrink, weight) = ((*m - m_new).exp(), (score - m_new).exp());
                    *l = *l * shrink + weight;
                    for (a, v) in acc.iter_mut().zip(&v_cache[at..at + d]) {
                        *a = *a * shrink + weight * v;
                    }
                    *m = m_new;
                }
            }
            let sink = scores.sinks.map_or(f32::NEG_INFINITY, |s| s[h]);
            let best = parts.iter().map(|p| p.0).fold(sink, f32::max);
            let orow = &mut out[(s * shape.heads + h) * d..][..d];
            for (e, o) in orow.iter_mut().enumerate() {
                let (mut total, mut sum) = (if sink == f32::NEG_INFINITY { 0.0 } else { (sink - best).exp() }, 0f32);
                for (m, l, acc) in parts.iter().filter(|p| p.1 > 0.0) {
                    let f = (m - best).exp();
                    total += f * l;
                    sum += f * acc[e];
                }
                *o = if total > 0.0 { sum / total } else { 0.0 };
            }
        }
    }
    Ok(out)
}

// ---- the sampler ----------------------------------------------------------

pub const BINS: usize = 2048;
const SPAN: f32 = 88.0;
const MASS_ONE: f32 = 4_294_967_296.0;

/// One row's sampling knobs, as the kernel reads them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowParams {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
    /// Which draw of the sequence this is (its output length): a new step
    /// draws new numbers from the same seed.
    pub step: u64,
}

impl RowParams {
    pub fn check(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if self.top_k < 0 {
            return Err(format!("top_k must be >= 0, got {}", self.top_k));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        f32::MAX
    } else {
        x
    }
}

fn allowed(mask: Option<&[i32]>, i: usize) -> bool {
    mask.is_none_or(|words| words.get(i / 32).is_some_and(|&w| (w as u32 >> (i % 32)) & 1 == 1))
}

fn bin_of(s: f32) -> usize {
    let b = -s * (BINS as f32 / SPAN);
    if b < (BINS - 1) as f32 { b.max(0.0) as usize } else { BINS - 1 }
}

fn sub_of(s: f32, bin: usize) -> usize {
    let width = SPAN / BINS as f32;
    let b = (-s - bin as f32 * width) * (BINS as f32 / width);
    if b < (BINS - 1) as f32 { b.max(0.0) as usize } else { BINS - 1 }
}

fn fixed_mass(s: f32) -> u64 {
    (s.exp() * MASS_ONE) as u64
}

/// Keeps the tokens whose (bin, sub-bin) is at or before (bin, sub).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cut {
    bin: usize,
    sub: usize,
}

const KEEP_ALL: Cut = Cut { bin: BINS, sub: 0 };

impl Cut {
    fn keeps(&self, s: f32) -> bool {
        let b = bin_of(s);
        b < self.bin || (b == self.bin && sub_of(s, b) <= self.sub)
    }
}

/// The first bin where the running count reaches `count` or the running
/// mass reaches `mass`, starting from (count, mass) already above.
fn scan(counts: &[u64], masses: &[u64], above: (u64, u64), count: u64, mass: u64) -> Option<usize> {
    let (mut c, mut w) = above;
    (0..BINS).find(|&b| {
        c += counts[b];
        w += masses[b];
        c >= count || w >= mass
    })
}

/// The cut within `within` that keeps its first `count` tokens or the first
/// `fraction` of its mass: two histogram levels, as the kernel.
fn search(s: &[f32], within: Cut, count: u64, fraction: f32) -> Cut {
    let (mut counts, mut masses) = (vec![0u64; BINS], vec![0u64; BINS]);
    for &v in s.iter().filter(|&&v| v > f32::NEG_INFINITY && within.keeps(v)) {
        counts[bin_of(v)] += 1;
        masses[bin_of(v)] += fixed_mass(v);
    }
    let total: u64 = masses.iter().sum();
    let need = if fraction < 1.0 { (f64::from(fraction) * total as f64) as u64 } else { u64::MAX };
    let Some(bin) = scan(&counts, &masses, (0, 0), count, need) else {
        return within;
    };
    let above = (counts[..bin].iter().sum(), masses[..bin].iter().sum());
    counts.fill(0);
    masses.fill(0);
    for &v in s.iter().filter(|&&v| v > f32::NEG_INFINITY && bin_of(v) == bin && within.keeps(v)) {
        counts[sub_of(v, bin)] += 1;
        masses[sub_of(v, bin)] += fixed_mass(v);
    }
    match scan(&counts, &masses, above, count, need) {
        Some(sub) => Cut { bin, sub },
        None => within,
    }
}

/// One row: `logits` [vocab], `mask` the row's packed words (None: all
/// allowed). Returns (token, log-probability under the distribution drawn
/// from), or (-1, -inf) when nothing is allowed.
pub fn masked_sample(logits: &[f32], mask: Option<&[i32]>, p: &RowParams) -> (i64, f32) {
    let x: Vec<f32> =
        logits.iter().enumerate().map(|(i, &v)| if allowed(mask, i) { clean(v) } else { f32::NEG_INFINITY }).collect();
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return (-1, f32::NEG_INFINITY);
    }
    if p.temperature == 0.0 {
        let at = x.iter().position(|&v| v == m).expect("the max is in the row");
        let z: f32 = x.iter().map(|v| (v - m).exp()).sum();
        return (at as i64, -z.ln());
    }
    let inv_t = 1.0 / p.temperature;
    let s: Vec<f32> = x.iter().map(|&v| (v - m) * inv_t).collect();
    let mut cut = KEEP_ALL;
    if p.top_k > 0 {
        cut = search(&s, cut, p.top_k as u64, 1.0);
    }
    if p.top_p < 1.0 {
        cut = search(&s, cut, u64::MAX, p.top_p);
    }
    let floor = if p.min_p > 0.0 { p.min_p.ln() } else { f32::NEG_INFINITY };
    let (mut key, mut pick, mut mass) = (f32::NEG_INFINITY, usize::MAX, 0f32);
    for (i, &v) in s.iter().enumerate() {
        if v == f32::NEG_INFINITY || v < floor || !cut.keeps(v) {
            continue;
        }
        mass += v.exp();
        let k = v + gumbel(p.seed, p.step, i as u32);
        if k > key {
            (key, pick) = (k, i);
        }
    }
    (pick as i64, s[pick] - mass.ln())
}

/// Penalties, bias and bans for `guided_adjust_logits`: one entry per
/// distinct (row, token), then the per-row penalties.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Adjustments {
    pub rows: Vec<i32>,
    pub tokens: Vec<i32>,
    /// 1 where the token is in the prompt or output (repetition penalty).
    pub seen: Vec<i32>,
    /// Occurrences in the output (frequency and presence penalties).
    pub counts: Vec<i32>,
    /// The summed logit bias; -inf bans the token.
    pub bias: Vec<f32>,
    pub repetition: Vec<f32>,
    pub frequency: Vec<f32>,
    pub presence: Vec<f32>,
}

/// Penalties, logit bias and bans in place on `logits` [rows, vocab], entry
/// by entry, as `guided_adjust_logits` applies them (the CPU sampler's
/// order: repetition, then frequency and presence, then the bias).
pub fn adjust_logits(logits: &mut [f32], vocab: usize, a: &Adjustments) -> Result<(), String> {
    let rows = if vocab == 0 { 0 } else { logits.len() / vocab };
    let n = a.rows.len();
    if [a.tokens.len(), a.seen.len(), a.counts.len(), a.bias.len()].iter().any(|&l| l != n) {
        return Err("rows, tokens, seen, counts and bias must have one value per entry".into());
    }
    if [a.repetition.len(), a.frequency.len(), a.presence.len()].iter().any(|&l| l != rows) {
        return Err(format!("repetition, frequency and presence must have {rows} rows, as the logits"));
    }
    for e in 0..n {
        let (row, token) = (a.rows[e], a.tokens[e]);
        if row < 0 || row as usize >= rows || token < 0 || token as usize >= vocab {
            return Err(format!("entry {e} names row {row}, token {token}: outside the logits [{rows}, {vocab}]"));
        }
        let (row, x) = (row as usize, &mut logits[row as usize * vocab + token as usize]);
        let mut v = clean(*x);
        if a.seen[e] != 0 {
            let rp = a.repetition[row];
            v = if v > 0.0 { v / rp } else { v * rp };
        }
        if a.counts[e] > 0 {
            v -= a.frequency[row] * a.counts[e] as f32 + a.presence[row];
        }
        *x = v + a.bias[e];
    }
    Ok(())
}

/// Device pointers of a sampling call: logits [rows, vocab] float32, mask
/// [rows, words] int32 or 0, per-row temperature/top_p/min_p float32,
/// top_k int32, seeds and steps uint64; tokens int64 and logprobs float32
/// written.
#[derive(Debug, Clone, Copy)]
pub struct SamplePointers {
    pub logits: u64,
    pub mask: u64,
    pub temperature: u64,
    pub top_k: u64,
    pub top_p: u64,
    pub min_p: u64,
    pub seeds: u64,
    pub steps: u64,
    pub tokens: u64,
    pub logprobs: u64,
}

/// What the kernel's launcher checks of a sampling call: the sizes agree
/// and every row's knobs are valid.
pub fn check_sample(rows: usize, vocab: usize, words: Option<usize>, params: &[RowParams]) -> Result<(), String> {
    if vocab == 0 || vocab > i32::MAX as usize {
        return Err(format!("vocab must be in 1..2^31, got {vocab}"));
    }
    if let Some(w) = words {
        if w < vocab.div_ceil(32) {
            return Err(format!("the mask has {w} words per row; {vocab} tokens need {}", vocab.div_ceil(32)));
        }
    }
    if params.len() != rows {
        return Err(format!("{} rows of logits but {} rows of parameters", rows, params.len()));
    }
    for (r, p) in params.iter().enumerate() {
        p.check().map_err(|e| format!("row {r}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32, top_k: i32, top_p: f32, min_p: f32, seed: u64) -> RowParams {
        RowParams { temperature, top_k, top_p, min_p, seed, step: 0 }
    }

    #[test]
    fn greedy_is_the_first_allowed_max() {
        let logits = [1.0, 5.0, 5.0, 2.0, 9.0];
        let mask = [0b01111]; // token 4 not allowed
        let (t, lp) = masked_sample(&logits, Some(&mask), &row(0.0, 0, 1.0, 0.0, 0));
        assert_eq!(t, 1);
        let z: f32 = [1.0f32, 5.0, 5.0, 2.0].iter().map(|v| (v - 5.0).exp()).sum();
        assert!((lp + z.ln()).abs() < 1e-6);
        assert_eq!(masked_sample(&logits, Some(&[0]), &row(1.0, 0, 1.0, 0.0, 0)), (-1, f32::NEG_INFINITY));
    }

    #[test]
    fn filters_keep_what_they_should() {
        let logits: Vec<f32> = (0..100).map(|i| -(i as f32) * 0.1).collect();
        for seed in 0..200 {
            let (t, _) = masked_sample(&logits, None, &row(1.0, 3, 1.0, 0.0, seed));
            assert!(t < 3, "top-k 3 drew {t}");
            let (t, _) = masked_sample(&logits, None, &row(1.0, 0, 1.0, 0.8, seed));
            assert!(logits[t as usize] >= 0.8f32.ln() - 1e-6, "min-p drew {t}");
        }
        // top-p 0.3 of a geometric row: the smallest prefix holding 30% of the mass
        let mass: Vec<f32> = logits.iter().map(|v| v.exp()).collect();
        let total: f32 = mass.iter().sum();
        let mut acc = 0.0;
        let need = mass.iter().position(|m| {
            acc += m;
            acc >= 0.3 * total
        });
        for seed in 0..200 {
            let (t, lp) = masked_sample(&logits, None, &row(1.0, 0, 0.3, 0.0, seed));
            assert!(t as usize <= need.unwrap(), "top-p drew {t}");
            assert!(lp <= 0.0);
        }
    }

    #[test]
    fn seeded_draws_repeat_and_steps_differ() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let a: Vec<i64> = (0..50).map(|step| masked_sample(&logits, None, &RowParams { step, ..row(1.0, 0, 1.0, 0.0, 7) }).0).collect();
        let b: Vec<i64> = (0..50).map(|step| masked_sample(&logits, None, &RowParams { step, ..row(1.0, 0, 1.0, 0.0, 7) }).0).collect();
        assert_eq!(a, b);
        assert!(a.iter().collect::<std::collections::HashSet<_>>().len() > 5);
    }

    #[test]
    fn greedy_agrees_with_the_cpu_sampler_on_the_same_mask_words() {
        use crate::sampling::random::{mix64, Stream};
        use crate::sampling::cpu_sampler::{sample_row, Row, SamplingParams};
        let mut rng = Stream::new(Some(3));
        let params = SamplingParams { logprobs: Some(0), ..SamplingParams::default() }; // its logprob too
        let row = Row { params: &params, prompt: &[], output: &[], banned: &[] };
        for case in 0u64..20 {
            let vocab = 1000 + case as usize * 37; // not a multiple of 32
            let logits: Vec<f32> = (0..vocab).map(|i| (mix64(case * 10_000 + i as u64) >> 40) as f32 / 1e6).collect();
            let words: Vec<i32> = (0..vocab.div_ceil(32)).map(|w| mix64(case + w as u64 * 7) as i32).collect();
            let cpu = sample_row(&logits, Some(&words), &row, &mut rng);
            let (token, logprob) = masked_sample(&logits, Some(&words), &RowParams { temperature: 0.0, ..row_params() });
            assert_eq!(token, cpu.token, "case {case}");
            assert!((logprob - cpu.logprob).abs() < 1e-4, "case {case}: {logprob} vs {}", cpu.logprob);
        }
    }

    #[test]
    fn seeded_draws_agree_with_the_cpu_sampler() {
        use crate::sampling::random::{mix64, Stream};
        use crate::sampling::cpu_sampler::{sample_row, Row, SamplingParams};
        let knobs = [(0.8, 0, 1.0, 0.0), (1.3, 0, 1.0, 0.05), (1.0, 40, 1.0, 0.0), (0.7, 0, 1.0, 0.2)];
        let (mut same, mut draws) = (0, 0);
        for case in 0u64..40 {
            let vocab = 2000 + case as usize * 13;
            // distinct logits, a few nats apart at the top: the top-k cut is exact for both
            let logits: Vec<f32> = (0..vocab).map(|i| (mix64(case * 100_000 + i as u64) >> 44) as f32 / 1e4 - 50.0).collect();
            let words: Vec<i32> = (0..vocab.div_ceil(32)).map(|w| (mix64(case ^ (w as u64 * 7)) | 1) as i32).collect();
            let (temperature, top_k, top_p, min_p) = knobs[case as usize % knobs.len()];
            let params = SamplingParams { temperature, top_k, top_p, min_p, logprobs: Some(0), ..SamplingParams::default() };
            let row = Row { params: &params, prompt: &[], output: &[], banned: &[] };
            let mut stream = Stream::new(Some(case));
            for step in 0..5 {
                let cpu = sample_row(&logits, Some(&words), &row, &mut stream);
                let rp = RowParams { temperature, top_k: top_k as i32, top_p, min_p, seed: case, step };
                let (token, logprob) = masked_sample(&logits, Some(&words), &rp);
                draws += 1;
                same += usize::from(token == cpu.token);
                if token == cpu.token {
                    assert!((logprob - cpu.logprob).abs() < 1e-3, "case {case}: {logprob} vs {}", cpu.logprob);
                }
            }
        }
        // the same stream and the same Gumbel-max: equal but for a tie in the last bit
        assert_eq!(same, draws, "{same} of {draws} draws agree");
    }

    fn row_params() -> RowParams {
        row(1.0, 0, 1.0, 0.0, 0)
    }

    #[test]
    fn bad_calls_are_refused() {
        let paged = Layout { heads: 6, kv_heads: 4, head_size: 64, num_blocks: 2, block_size: 16, max_blocks: 2 };
        let shape = DecodeShape { seqs: 1, paged };
        assert!(shape.check().unwrap_err().contains("multiple of kv_heads"));
        let shape = DecodeShape { paged: Layout { heads: 8, head_size: 80, ..paged }, ..shape };
        assert!(shape.check().unwrap_err().contains("head size 80"));
        let shape = DecodeShape { paged: Layout { heads: 8, ..paged }, ..shape };
        assert!(shape.check_tables(&[0, 5], &[20]).unwrap_err().contains("block 5"));
        assert!(shape.check_tables(&[0, 1], &[40]).unwrap_err().contains("longer"));
        assert!(check_sample(1, 100, Some(3), &[row(1.0, 0, 1.0, 0.0, 0)]).unwrap_err().contains("need 4"));
        assert!(check_sample(1, 100, None, &[row(1.0, 0, 0.0, 0.0, 0)]).unwrap_err().contains("top_p"));
    }
}
