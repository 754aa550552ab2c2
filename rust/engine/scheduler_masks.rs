//! The scheduler's grammar masks: started before the forward pass
//! (masks.rs's job), joined by `sample()`, and on demand (`MaskPolicy`) the
//! rows drawn without theirs checked, the refused ones masked and drawn again.

use std::collections::HashMap;
use std::time::Instant;

use super::{Error, Scheduler};
use crate::threads::pool;
use crate::engine::masks::{MaskBatch, MaskJob, MaskPolicy, MaskSpan};
use crate::engine::sequence::{Constraint, SeqId};
use crate::sampling::cpu_sampler::{sample_rows, Sampled};
use crate::sampling::random::Stream;

impl Scheduler {

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
        let spans: Vec<MaskSpan> = flight
            .spans
            .iter()
            .map(|span| {
                let row = (|| {
                    let c = self.seqs.get_mut(&span.id)?.constraint.as_mut()?;
                    Some((span.id, c.matcher.take()?, None))
                })();
                let on_demand = self.cfg.masks == MaskPolicy::OnDemand
                    && self.seqs.get(&span.id).is_some_and(|s| s.sampling.mask_can_wait());
                MaskSpan { row, draft: span.draft.tokens.clone(), needed: span.draft.drawn_rows(), on_demand }
            })
            .collect();
        if spans.iter().any(|s| s.row.is_some()) {
            self.masks = Some(MaskJob::start(spans, self.cfg.masks));
        }
        Ok(())
    }

    /// Wait for the mask job, if any, and give the matchers back to their
    /// sequences (those aborted meanwhile are dropped).
    pub(super) fn join_masks(&mut self) -> Option<MaskBatch> {
        let job = self.masks.take()?;
        let t0 = Instant::now();
        let inline = matches!(job, MaskJob::Done(_));
        let batch = job.join();
        self.counters.mask_wait_us += t0.elapsed().as_micros() as u64;
        let mut batch = batch?;
        self.counters.mask_time_us += batch.elapsed_us;
        if inline {
            // computed before the forward pass: the step waited for all of it
            self.counters.mask_wait_us += batch.elapsed_us;
        }
        self.counters.mask_rows += batch.has_mask.iter().filter(|&&h| h).count() - batch.draft_rows;
        self.counters.drafts.mask_us += batch.draft_us;
        self.counters.drafts.mask_rows += batch.draft_rows;
        self.counters.mask_rows_on_demand += batch.deferred.iter().filter(|&&d| d).count();
        for (id, m, err) in std::mem::take(&mut batch.rows).into_iter().flatten() {
            if let Some(c) = self.seqs.get_mut(&id).and_then(|s| s.constraint.as_mut()) {
                c.mask_error = err;
                c.matcher = Some(m);
            }
        }
        Some(batch)
    }

    /// The rows drawn without their grammar's mask (`MaskBatch::deferred`):
    /// a token the grammar allows is the masked draw's and stays; the other
    /// rows get their mask now and are drawn again from the stream they
    /// started from (`streams`, per row of `which`), so each row's token is
    /// the one a mask computed beforehand would have given. Rows checked in
    /// parallel, as masks are computed. (A kept row's logprob is under the
    /// unmasked row; such rows never report logprobs.)
    #[allow(clippy::too_many_arguments)]
    pub(super) fn redraw_refused(&mut self, batch: &MaskBatch, logits: &[f32], vocab: usize, which: &[usize], ids: &[SeqId],
                      streams: &[Option<Stream>], mask: Option<(&[i32], usize)>, out: &mut [Sampled]) {
        let deferred: HashMap<SeqId, (usize, i64)> = which
            .iter()
            .enumerate()
            .filter(|(_, &i)| batch.deferred[i])
            .map(|(k, _)| (ids[k], (k, out[k].token)))
            .collect();
        if deferred.is_empty() {
            return;
        }
        let t0 = Instant::now();
        // each row's (index, token), grammar, and mask where it refuses the token
        let mut work: Vec<((usize, i64), &mut Constraint, Option<Vec<i32>>)> =
            self.seqs.iter_mut().filter_map(|(id, s)| Some((*deferred.get(id)?, s.constraint.as_mut()?, None))).collect();
        // on the kernels' pool, as the rows are drawn (cpu_sampler::sample_rows): its helpers
        // still spin from the forward pass, where rayon's would have to wake beside them
        pool::for_each_mut(&mut work, &|((_, token), c, slot)| {
            let Some(m) = c.matcher.as_mut() else { return };
            if u32::try_from(*token).is_ok_and(|t| m.allows(t)) {
                return;
            }
            let (words, err) = m.compute_mask();
            c.mask_error = err;
            *slot = Some(words);
        });
        let mut refused: Vec<(usize, Vec<i32>)> =
            work.into_iter().filter_map(|((k, _), _, words)| Some((k, words?))).collect();
        self.counters.mask_rows_refused += refused.len();
        self.counters.mask_rows += refused.len();
        if !refused.is_empty() {
            let sub_ids: Vec<SeqId> = refused.iter().map(|(k, _)| ids[*k]).collect();
            let sub_logits: Vec<f32> = refused.iter().flat_map(|(k, _)| &logits[k * vocab..(k + 1) * vocab]).copied().collect();
            if let Some((ext, w)) = mask {
                // ANDed as row_masks does: words past the shorter one disallow
                for (k, g) in &mut refused {
                    g.truncate(w);
                    g.iter_mut().zip(&ext[which[*k] * w..(which[*k] + 1) * w]).for_each(|(a, b)| *a &= b);
                }
            }
            let masks: Vec<Option<&[i32]>> = refused.iter().map(|(_, g)| Some(&g[..])).collect();
            for (id, (k, _)) in sub_ids.iter().zip(&refused) {
                if let (Some(seq), Some(rng)) = (self.seqs.get_mut(id), streams[*k]) {
                    seq.rng = rng;
                }
            }
            let again = self.with_rows(&sub_ids, |rows_in, rngs| sample_rows(&sub_logits, vocab, &masks, rows_in, rngs));
            for ((k, _), s) in refused.iter().zip(again) {
                out[*k] = s;
            }
        }
        let us = t0.elapsed().as_micros() as u64;
        self.counters.mask_time_us += us;
        self.counters.mask_wait_us += us;
    }

    /// Give the rows `device_rows()` samples on the device the masks they
    /// were left without (`MaskBatch::deferred`): it draws every row at once.
    pub(super) fn fill_deferred(&mut self, batch: &mut MaskBatch) {
        let ids = self.in_flight.as_ref().map(|f| f.sample_ids.clone()).unwrap_or_default();
        let rows: Vec<usize> = (0..ids.len()).filter(|&i| batch.deferred[i]).collect();
        for (i, id) in rows.into_iter().map(|i| (i, ids[i])) {
            let Some(c) = self.seqs.get_mut(&id).and_then(|s| s.constraint.as_mut()) else { continue };
            let Some(m) = c.matcher.as_mut() else { continue };
            let at = i * batch.words;
            c.mask_error = m.fill_mask(&mut batch.buf[at..at + m.words()]).err();
            batch.has_mask[i] = true;
            batch.deferred[i] = false;
            self.counters.mask_rows += 1;
        }
    }
}
