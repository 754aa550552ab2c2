//! One step's sampling rows as the device sampler reads them: the inputs of
//! `cuda/sampling.cu`'s two kernels (`guided_adjust_logits`, then
//! `guided_masked_sample`), built from the rows the CPU sampler
//! (`sampling/cpu_sampler.rs`) reads, so a step sampled on the device draws what the
//! host would have drawn.
//!
//! - Penalties, logit bias and min_tokens bans become one entry per distinct
//!   (row, token): the few tokens a row names, not a pass over the row.
//! - The masks are one `rows × words` buffer whose words cover the whole
//!   vocabulary (the kernel reads no word past it); a row without a grammar
//!   allows everything, and no buffer at all is made when no row has one.
//! - Each row draws the next number of its sequence's own seeded stream
//!   (`sampling/random.rs`), advanced here as `cpu_sampler::sample_row` advances it.
//! - Rows that ask for top logprobs are marked `host`: the CPU sampler
//!   draws them (it has the sorted alternatives); their streams are left
//!   for it to advance.

use std::collections::BTreeMap;

use crate::cuda::reference::{Adjustments, RowParams};
use crate::sampling::random::Stream;
use crate::sampling::cpu_sampler::Row;

/// Everything the device sampler reads for one step's rows.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceRows {
    /// Words per mask row (⌈vocab / 32⌉), 0 when no row has a mask.
    pub words: usize,
    /// `rows × words` packed bits (bit j of word i allows token 32·i + j).
    pub mask: Vec<i32>,
    pub params: Vec<RowParams>,
    pub adjust: Adjustments,
    /// Rows the host samples (they ask for top logprobs).
    pub host: Vec<bool>,
}

/// The device sampler's inputs for `rows`, whose grammar masks are `masks`
/// (None: unconstrained); advances the streams of the rows it draws.
pub fn device_rows(vocab: usize, masks: &[Option<&[i32]>], rows: &[Row<'_>], rngs: &mut [Stream]) -> DeviceRows {
    assert_eq!(masks.len(), rows.len(), "one mask slot per row");
    assert_eq!(rngs.len(), rows.len(), "one rng per row");
    let words = if masks.iter().any(Option::is_some) { vocab.div_ceil(32) } else { 0 };
    let mut mask = vec![0i32; rows.len() * words];
    for (out, m) in mask.chunks_mut(words.max(1)).zip(masks) {
        match m {
            // words past the grammar's own are disallowed, as on the host
            Some(m) => out.iter_mut().zip(m.iter()).for_each(|(o, &w)| *o = w),
            None => out.fill(-1),
        }
    }
    let mut adjust = Adjustments::default();
    let mut params = Vec::with_capacity(rows.len());
    let mut host = Vec::with_capacity(rows.len());
    for (i, (row, rng)) in rows.iter().zip(rngs.iter_mut()).enumerate() {
        let p = row.params;
        params.push(RowParams {
            temperature: p.temperature,
            top_k: i32::try_from(p.top_k).unwrap_or(i32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            seed: rng.seed,
            step: rng.step,
        });
        let on_host = p.logprobs.is_some();
        if !on_host {
            rng.step += 1;
        }
        host.push(on_host);
        adjust.repetition.push(p.repetition_penalty);
        adjust.frequency.push(p.frequency_penalty);
        adjust.presence.push(p.presence_penalty);
        for (token, (seen, count, bias)) in entries(vocab, row) {
            adjust.rows.push(i as i32);
            adjust.tokens.push(token as i32);
            adjust.seen.push(i32::from(seen));
            adjust.counts.push(count);
            adjust.bias.push(bias);
        }
    }
    DeviceRows { words, mask, params, adjust, host }
}

/// One row's tokens that need an adjustment: (seen, output count, bias),
/// in the CPU sampler's terms (only what changes a logit is listed).
fn entries(vocab: usize, row: &Row<'_>) -> BTreeMap<u32, (bool, i32, f32)> {
    let p = row.params;
    let mut e: BTreeMap<u32, (bool, i32, f32)> = BTreeMap::new();
    let inside = |t: &&u32| (**t as usize) < vocab;
    if p.repetition_penalty != 1.0 {
        for &t in row.prompt.iter().chain(row.output).filter(inside) {
            e.entry(t).or_default().0 = true;
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        for &t in row.output.iter().filter(inside) {
            e.entry(t).or_default().1 += 1;
        }
    }
    for (t, b) in p.logit_bias.iter().filter(|(t, _)| (*t as usize) < vocab) {
        e.entry(*t).or_default().2 += b;
    }
    for &t in row.banned.iter().filter(inside) {
        e.entry(t).or_default().2 = f32::NEG_INFINITY;
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::reference::{adjust_logits, masked_sample};
    use crate::sampling::random::Stream;
    use crate::sampling::cpu_sampler::{sample_row, SamplingParams};
    use proptest::prelude::*;

    /// The rows' params asking for the sampled token's logprob too, which the host computes only
    /// when asked (the draw is the same either way): the host's reference for the device's.
    fn asking(rows: &[Row<'_>]) -> Vec<SamplingParams> {
        rows.iter().map(|r| SamplingParams { logprobs: Some(0), ..r.params.clone() }).collect()
    }

    fn logits(vocab: usize, salt: u32) -> Vec<f32> {
        (0..vocab as u32).map(|i| ((i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 1_000_003) as f32 / 100_000.0 - 5.0).collect()
    }

    /// The reference kernels fed by `device_rows` draw what the CPU sampler
    /// draws, row for row, with penalties, bias, bans, masks and seeds.
    #[test]
    fn device_inputs_draw_what_the_host_draws() {
        let vocab = 300;
        let grammar: Vec<i32> = (0..8).map(|w| if w % 2 == 0 { 0x5555_5555 } else { -1 }).collect();
        let short = [-1i32; 3]; // tokens past word 3 disallowed
        let mut all = Vec::new();
        for (t, k, p, m) in [(0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (1.0, 40, 1.0, 0.0), (0.7, 0, 0.9, 0.05)] {
            for (rep, freq, pres) in [(1.0, 0.0, 0.0), (1.3, 0.5, 0.4)] {
                all.push(SamplingParams {
                    temperature: t,
                    top_k: k,
                    top_p: p,
                    min_p: m,
                    repetition_penalty: rep,
                    frequency_penalty: freq,
                    presence_penalty: pres,
                    logit_bias: vec![(5, 3.0), (7, -2.0), (5, 1.0), (9_999, 4.0)],
                    logprobs: None,
                });
            }
        }
        let prompt = [3u32, 5, 5, 17, 250];
        let output = [5u32, 6, 6, 6, 299];
        let banned = [6u32, 11];
        let rows: Vec<Row<'_>> = all.iter().map(|p| Row { params: p, prompt: &prompt, output: &output, banned: &banned }).collect();
        let masks: Vec<Option<&[i32]>> = (0..rows.len()).map(|i| [None, Some(&grammar[..]), Some(&short[..])][i % 3]).collect();
        let asked = asking(&rows);
        for step in 0..30u64 {
            let x: Vec<f32> = (0..rows.len() as u32).flat_map(|r| logits(vocab, r * 31 + step as u32)).collect();
            let mut host_rngs: Vec<Stream> = (0..rows.len()).map(|i| Stream { seed: 40 + i as u64, step }).collect();
            let mut dev_rngs = host_rngs.clone();
            let d = device_rows(vocab, &masks, &rows, &mut dev_rngs);
            assert_eq!(d.words, vocab.div_ceil(32));
            let mut y = x.clone();
            adjust_logits(&mut y, vocab, &d.adjust).unwrap();
            for (i, row) in rows.iter().enumerate() {
                let want = sample_row(&x[i * vocab..(i + 1) * vocab], masks[i], &Row { params: &asked[i], ..*row }, &mut host_rngs[i]);
                let mask = (d.words > 0).then(|| &d.mask[i * d.words..(i + 1) * d.words]);
                let (token, logprob) = masked_sample(&y[i * vocab..(i + 1) * vocab], mask, &d.params[i]);
                assert_eq!(token, want.token, "row {i} step {step}");
                assert!((logprob - want.logprob).abs() < 1e-3, "row {i}: {logprob} vs {}", want.logprob);
            }
            assert_eq!(dev_rngs, host_rngs, "both advance each stream once");
        }
    }

    /// A row as the generator makes it: knobs, prompt and output tokens
    /// (some past the vocabulary), bias entries (repeats and strays
    /// included), banned tokens, a mask or none, a seed and a step.
    #[derive(Debug, Clone)]
    struct GenRow {
        params: SamplingParams,
        prompt: Vec<u32>,
        output: Vec<u32>,
        banned: Vec<u32>,
        mask: Option<Vec<i32>>,
        stream: Stream,
    }

    fn gen_row(vocab: u32) -> impl Strategy<Value = GenRow> {
        let tokens = || proptest::collection::vec(0..vocab + 8, 0..12);
        let knobs = (prop_oneof![Just(0.0f32), 0.05f32..2.0], prop_oneof![Just(0.0f32), 0.0f32..0.3]);
        let penalties = (prop_oneof![Just(1.0f32), 0.5f32..2.0], -1.0f32..1.0, -1.0f32..1.0);
        let bias = proptest::collection::vec((0..vocab + 4, -100.0f32..100.0), 0..5);
        let mask = proptest::option::of(proptest::collection::vec(any::<i32>(), 0..vocab.div_ceil(32) as usize + 1));
        (knobs, penalties, bias, tokens(), tokens(), tokens(), mask, any::<u64>(), 0u64..1000).prop_map(
            |((temperature, min_p), (rep, freq, pres), logit_bias, prompt, output, banned, mask, seed, step)| GenRow {
                params: SamplingParams {
                    temperature,
                    min_p,
                    repetition_penalty: rep,
                    frequency_penalty: freq,
                    presence_penalty: pres,
                    logit_bias,
                    ..SamplingParams::default()
                },
                prompt,
                output,
                banned,
                mask,
                stream: Stream { seed, step },
            },
        )
    }

    proptest! {
        /// Generated rows (any knobs but the top-k/top-p cut, whose
        /// histogram the grid test above and the kernels' tests cover): the
        /// kernels' reference fed by `device_rows` draws the CPU sampler's
        /// token with its logprob, and both advance each stream once.
        #[test]
        fn generated_rows_draw_what_the_host_draws(rows in proptest::collection::vec(gen_row(70), 1..6), salt in any::<u32>()) {
            let vocab = 70;
            let x: Vec<f32> = (0..rows.len() as u32).flat_map(|r| logits(vocab, salt ^ r)).collect();
            let sampler_rows: Vec<Row<'_>> = rows
                .iter()
                .map(|r| Row { params: &r.params, prompt: &r.prompt, output: &r.output, banned: &r.banned })
                .collect();
            let masks: Vec<Option<&[i32]>> = rows.iter().map(|r| r.mask.as_deref()).collect();
            let mut host_rngs: Vec<Stream> = rows.iter().map(|r| r.stream).collect();
            let mut dev_rngs = host_rngs.clone();
            let d = device_rows(vocab, &masks, &sampler_rows, &mut dev_rngs);
            let asked = asking(&sampler_rows);
            let mut y = x.clone();
            adjust_logits(&mut y, vocab, &d.adjust).unwrap();
            for (i, row) in sampler_rows.iter().enumerate() {
                let want = sample_row(&x[i * vocab..(i + 1) * vocab], masks[i], &Row { params: &asked[i], ..*row }, &mut host_rngs[i]);
                let mask = (d.words > 0).then(|| &d.mask[i * d.words..(i + 1) * d.words]);
                let (token, logprob) = masked_sample(&y[i * vocab..(i + 1) * vocab], mask, &d.params[i]);
                prop_assert_eq!(token, want.token, "row {}", i);
                if token >= 0 {
                    prop_assert!((logprob - want.logprob).abs() < 1e-3, "row {}: {} vs {}", i, logprob, want.logprob);
                }
            }
            prop_assert_eq!(dev_rngs, host_rngs);
        }
    }

    #[test]
    fn rows_asking_for_logprobs_stay_on_the_host() {
        let asks = SamplingParams { logprobs: Some(2), ..SamplingParams::default() };
        let plain = SamplingParams::default();
        let rows = [
            Row { params: &asks, prompt: &[], output: &[], banned: &[] },
            Row { params: &plain, prompt: &[], output: &[], banned: &[] },
        ];
        let mut rngs = [Stream { seed: 1, step: 4 }, Stream { seed: 2, step: 4 }];
        let d = device_rows(64, &[None, None], &rows, &mut rngs);
        assert_eq!(d.host, [true, false]);
        assert_eq!((rngs[0].step, rngs[1].step), (4, 5), "the host advances its own rows");
        assert_eq!((d.words, d.mask.len()), (0, 0), "no mask without a grammar");
        assert!(d.adjust.rows.is_empty(), "nothing to adjust");
    }
}
