//! The grammar masks of one step, computed on a background thread (rows in
//! parallel with rayon) while the model's forward pass runs (DESIGN rule 10).
//!
//! The job owns the matchers of the rows it computes and hands them back on
//! join, so no lock is taken per row.

use std::borrow::Cow;
use std::thread::JoinHandle;
use std::time::Instant;

use rayon::prelude::*;

use crate::grammar::GrammarMatcher;
use crate::sequence::SeqId;

/// One sampling row's grammar: its sequence and matcher, then the error of
/// its mask (if it allows nothing).
pub type MaskRow = Option<(SeqId, GrammarMatcher, Option<String>)>;

/// The masks of one step: `rows × words` int32 words, row i at `i * words`
/// (rows without a grammar are left zero and unused).
pub struct MaskBatch {
    pub words: usize,
    pub buf: Vec<i32>,
    /// Which rows have a mask.
    pub has_mask: Vec<bool>,
    pub rows: Vec<MaskRow>,
    /// Wall time the job took, from start to finish.
    pub elapsed_us: u64,
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

/// Compute every constrained row's mask (rows in parallel).
pub fn compute(mut rows: Vec<MaskRow>) -> MaskBatch {
    let t0 = Instant::now();
    let words = rows.iter().flatten().map(|(_, m, _)| m.words()).max().unwrap_or(0);
    let mut buf = vec![0i32; rows.len() * words];
    if words > 0 {
        buf.par_chunks_mut(words).zip(rows.par_iter_mut()).for_each(|(out, row)| {
            if let Some((_, m, err)) = row {
                let n = m.words();
                *err = m.fill_mask(&mut out[..n]).err();
            }
        });
    }
    let has_mask = rows.iter().map(Option::is_some).collect();
    MaskBatch { words, buf, has_mask, rows, elapsed_us: t0.elapsed().as_micros() as u64 }
}

/// A mask computation in flight.
pub struct MaskJob {
    handle: JoinHandle<MaskBatch>,
}

impl std::fmt::Debug for MaskJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MaskJob")
    }
}

impl MaskJob {
    pub fn spawn(rows: Vec<MaskRow>) -> Self {
        MaskJob { handle: std::thread::spawn(move || compute(rows)) }
    }

    /// The finished batch; None if the job died (its matchers are lost and
    /// those sequences end with an error).
    pub fn join(self) -> Option<MaskBatch> {
        self.handle.join().ok()
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
