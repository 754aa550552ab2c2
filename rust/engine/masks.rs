//! The grammar masks of one step, computed on a background thread (rows in
//! parallel with rayon) while the model's forward pass runs (DESIGN rule 10),
//! or, where the forward pass runs on the CPU's cores, before it on the
//! kernels' pool ([`MaskJob::start`]).
//!
//! The job owns the matchers of the rows it computes and hands them back on
//! join, so no lock is taken per row. A sequence carrying a draft
//! (speculative.rs) has a row after each draft token too: its matcher
//! consumes the draft on the way and is rolled back after.
//!
//! A row may also be left to be checked instead (`MaskSpan::on_demand`,
//! where the engine samples on the CPU that runs the forward pass, so the
//! job's threads compete with it): the job only confirms that the row's mask
//! is the tokens its grammar takes one by one, and `Scheduler::sample()`
//! checks the token drawn without it, computing the mask only where the
//! grammar refuses that token.

use std::borrow::Cow;
use std::thread::JoinHandle;
use std::time::Instant;

use rayon::prelude::*;

use crate::grammar::matchers::GrammarMatcher;
use crate::threads::pool;
use crate::engine::sequence::SeqId;

/// Where a constrained row's mask is computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MaskPolicy {
    /// Every row's, on the job's threads while the forward pass runs (on a
    /// GPU, whose forward pass leaves the CPU's cores free).
    #[default]
    Overlap,
    /// Where the forward pass runs on the same cores: a row whose draw the
    /// mask cannot change but by refusing its token
    /// ([`SamplingParams::mask_can_wait`](crate::sampling::cpu_sampler::SamplingParams::mask_can_wait))
    /// is drawn without it and checked; only a refused token's row gets its
    /// mask, and is drawn again from the same random stream.
    OnDemand,
}

impl MaskPolicy {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "overlap" => Ok(MaskPolicy::Overlap),
            "on_demand" => Ok(MaskPolicy::OnDemand),
            _ => Err(format!("masks must be \"overlap\" or \"on_demand\", got {s:?}")),
        }
    }
}

/// One sampling row's grammar: its sequence and matcher, then the error of
/// its mask (if it allows nothing).
pub type MaskRow = Option<(SeqId, GrammarMatcher, Option<String>)>;

/// One sequence's rows: its grammar (the first row's), the draft tokens fed
/// after its last token, which of the `draft.len() + 1` rows need a mask,
/// and whether a row without a draft may be drawn without its mask and
/// checked after (where its state's mask is checkable).
pub struct MaskSpan {
    pub row: MaskRow,
    pub draft: Vec<u32>,
    pub needed: Vec<bool>,
    pub on_demand: bool,
}

impl MaskSpan {
    /// A sequence without a draft: one row.
    pub fn single(row: MaskRow) -> Self {
        MaskSpan { row, draft: Vec::new(), needed: vec![true], on_demand: false }
    }

    fn rows(&self) -> usize {
        self.draft.len() + 1
    }
}

/// The masks of one step: `rows × words` int32 words, row i at `i * words`
/// (rows without a grammar are left zero and unused).
pub struct MaskBatch {
    pub words: usize,
    pub buf: Vec<i32>,
    /// Which rows have a mask.
    pub has_mask: Vec<bool>,
    /// Which rows were left to be checked (`MaskSpan::on_demand`): no mask yet.
    pub deferred: Vec<bool>,
    /// Per span, its grammar (to hand back) and first row's error.
    pub rows: Vec<MaskRow>,
    /// Wall time the job took, from start to finish.
    pub elapsed_us: u64,
    /// Of the work on all threads, the time and count of the masks after
    /// draft tokens.
    pub draft_us: u64,
    pub draft_rows: usize,
}

impl std::fmt::Debug for MaskBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MaskBatch").field("words", &self.words).field("rows", &self.rows.len()).finish()
    }
}

impl MaskBatch {
    pub fn row(&self, i: usize) -> Option<&[i32]> {
        self.has_mask[i].then(|| &self.buf[i * self.words..(i + 1) * self.words])
    }
}

/// Compute every constrained row's mask (spans in parallel: on the kernels'
/// pool where `on_pool`, else on rayon's).
pub fn compute(spans: Vec<MaskSpan>, on_pool: bool) -> MaskBatch {
    let t0 = Instant::now();
    let words = spans.iter().filter_map(|s| s.row.as_ref()).map(|(_, m, _)| m.words()).max().unwrap_or(0);
    let total: usize = spans.iter().map(MaskSpan::rows).sum();
    let mut buf = vec![0i32; total * words];
    let mut has_mask = vec![false; total];
    // Each span's share of the buffer and of has_mask.
    let mut parts = Vec::with_capacity(spans.len());
    let (mut rest, mut flags) = (&mut buf[..], &mut has_mask[..]);
    for s in &spans {
        let (a, b) = std::mem::take(&mut rest).split_at_mut(s.rows() * words);
        let (f, g) = std::mem::take(&mut flags).split_at_mut(s.rows());
        parts.push((a, f));
        (rest, flags) = (b, g);
    }
    let mut spans = spans;
    let filled: Vec<Filled> = if on_pool {
        let mut work: Vec<_> = spans.iter_mut().zip(parts).map(|(span, part)| (span, part, Filled::default())).collect();
        pool::for_each_mut(&mut work, &|(span, (out, flags), filled)| *filled = fill_span(span, out, flags, words));
        work.into_iter().map(|(_, _, f)| f).collect()
    } else {
        spans
            .par_iter_mut()
            .zip(parts.into_par_iter())
            .map(|(span, (out, flags))| fill_span(span, out, flags, words))
            .collect()
    };
    let mut deferred = vec![false; total];
    let mut first = 0;
    for (s, f) in spans.iter().zip(&filled) {
        deferred[first] = f.deferred;
        first += s.rows();
    }
    let rows = spans.into_iter().map(|s| s.row).collect();
    let (draft_us, draft_rows) = filled.iter().fold((0, 0), |(t, n), f| (t + f.draft_us, n + f.draft_rows));
    let elapsed_us = t0.elapsed().as_micros() as u64;
    MaskBatch { words, buf, has_mask, deferred, rows, elapsed_us, draft_us, draft_rows }
}

/// What [`fill_span`] did: the time and count of its draft rows' masks, and
/// whether it left its row to be checked.
#[derive(Default)]
struct Filled {
    draft_us: u64,
    draft_rows: usize,
    deferred: bool,
}

/// One span's masks: the first row's, then, consuming the draft token by
/// token, each needed row's after it (a row the grammar cannot reach, after
/// a draft token it refuses, gets none); the matcher is rolled back after.
/// A row on demand whose mask is checkable gets none.
fn fill_span(span: &mut MaskSpan, out: &mut [i32], flags: &mut [bool], words: usize) -> Filled {
    let Some((_, m, err)) = &mut span.row else { return Filled::default() };
    if span.on_demand && span.draft.is_empty() && m.mask_is_checkable() {
        return Filled { deferred: true, ..Filled::default() };
    }
    let n = m.words();
    *err = m.fill_mask(&mut out[..n]).err();
    flags[0] = true;
    if span.draft.is_empty() || err.is_some() {
        return Filled::default();
    }
    let t0 = Instant::now();
    let (mut consumed, mut count) = (0, 0);
    for (r, &t) in span.draft.iter().enumerate() {
        if m.try_consume(&[t]) != Ok(1) {
            break;
        }
        consumed += 1;
        let row = r + 1;
        // A grammar that is done allows only the end tokens: no draft row needs it.
        if !span.needed[row] || m.is_stopped() {
            continue;
        }
        let at = row * words;
        if m.fill_draft_mask(&mut out[at..at + n]) {
            flags[row] = true;
            count += 1;
        }
    }
    let _ = m.rollback(consumed);
    Filled { draft_us: t0.elapsed().as_micros() as u64, draft_rows: count, deferred: false }
}

/// A step's masks: computed on a thread of their own while the forward pass
/// runs, or already computed (before it, on the kernels' pool).
pub enum MaskJob {
    Running(JoinHandle<MaskBatch>),
    Done(MaskBatch),
}

impl std::fmt::Debug for MaskJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MaskJob")
    }
}

impl MaskJob {
    /// Start the masks of `spans` as `policy` says: [`MaskPolicy::Overlap`]
    /// on a thread beside the forward pass (rows on rayon's threads: the
    /// forward pass leaves the cores free), [`MaskPolicy::OnDemand`] here and
    /// now on the kernels' pool. The forward pass then has every core: a
    /// thread beside it took a core from one of its loops' threads, whose
    /// partners wait at the loop's end (on 2 cores a step with one mask to
    /// compute took 5% longer), and most rows are only checked, later.
    pub fn start(spans: Vec<MaskSpan>, policy: MaskPolicy) -> Self {
        match policy {
            MaskPolicy::Overlap => MaskJob::Running(std::thread::spawn(move || compute(spans, false))),
            MaskPolicy::OnDemand => MaskJob::Done(compute(spans, true)),
        }
    }

    /// The finished batch; None if the job died (its matchers are lost and
    /// those sequences end with an error).
    pub fn join(self) -> Option<MaskBatch> {
        match self {
            MaskJob::Running(handle) => handle.join().ok(),
            MaskJob::Done(batch) => Some(batch),
        }
    }
}

/// Each sampling row's mask: the grammar's, the caller's (`rows × words`
/// int32 words), or both ANDed (words past the shorter one are disallowed).
pub fn row_masks<'a>(batch: Option<&'a MaskBatch>, external: Option<(&'a [i32], usize)>, rows: usize) -> Vec<Cow<'a, [i32]>> {
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
