//! Attention over the paged KV cache on the CPU, for every row of a step:
//! prefill chunks and decodes alike, in one call per layer.
//!
//! Each query row is computed on its own, by the same operations in the same
//! order whatever else the step holds: its scores over the positions it sees,
//! in position order; their softmax; the weighted sum of the values, in
//! position order. So a row's result does not depend on the batch it shares,
//! the chunk its prompt was prefilled in, or whether its prefix came from the
//! cache. Torch's SDPA over gathered blocks padded to the batch's longest
//! context gives none of that: its blocking follows the padded length, and
//! with 8-bit activations after it (the quantized matmuls) a last-bit
//! difference becomes a different token.
//!
//! Tasks are (group of rows, kv head) pairs on `pool.rs`'s threads: the g
//! query heads of a kv head share every key and value read, and so do the
//! rows of a group where their block tables name the same blocks (a prefill
//! chunk's rows, requests on one cached prompt: `share_prefixes`), which reads
//! a shared prompt once a group, not once a row. Keys and values are read in
//! place through the block table (nothing is gathered), as f32 or bf16.

use std::cell::RefCell;

use crate::threads::pool::{self, SendPtr};
use crate::cpu::simd::avx2;
#[cfg(target_arch = "x86_64")]
use crate::cpu::simd::{exp8_one, exp_minus, hsum4};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// A cached key or value element.
pub trait KvElem: Copy + Send + Sync {
    fn f32(self) -> f32;
    /// Eight elements widened to f32 (AVX2 callers only).
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(at: *const Self) -> __m256;
}

impl KvElem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(at: *const f32) -> __m256 {
        _mm256_loadu_ps(at)
    }
}

/// bfloat16, as its bits.
impl KvElem for u16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(at: *const u16) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(at as *const __m128i)), 16))
    }
}

/// The paged cache's sizes: caches are [num_blocks, block_size, kv_heads, head_size],
/// block tables [sequences, max_blocks] (also the CUDA decode kernel's, `cuda::reference::DecodeShape`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

/// How a layer turns q·k into weights.
#[derive(Debug, Clone, Copy)]
pub struct Scores {
    pub scale: f32,
    /// Only the last `window` positions (the row's own included) are seen.
    pub window: Option<usize>,
    /// Scores become `tanh(s / cap) · cap` (Gemma 2).
    pub softcap: Option<f32>,
}

/// Which sequence each query row belongs to (a row of `tables`) and its
/// position: the row sees positions 0..=pos of its sequence (their K/V already written).
pub struct Rows<'a> {
    pub tables: &'a [i32],
    pub seq: &'a [i32],
    pub pos: &'a [i32],
}

impl Layout {
    fn check<T>(&self, q: &[f32], k: &[T], v: &[T], rows: &Rows, sinks: Option<&[f32]>, out: &[f32]) -> Result<(), String> {
        if self.kv_heads == 0 || self.heads % self.kv_heads != 0 {
            return Err(format!("heads ({}) must be a multiple of kv_heads ({})", self.heads, self.kv_heads));
        }
        if self.head_size == 0 || self.block_size == 0 {
            return Err("head_size and block_size must be positive".into());
        }
        let n = rows.seq.len();
        if rows.pos.len() != n || q.len() != n * self.heads * self.head_size || out.len() != q.len() {
            return Err(format!(
                "q and out must be [{n}, {}, {}] for {n} rows with positions",
                self.heads, self.head_size
            ));
        }
        let cache = self.num_blocks * self.block_size * self.kv_heads * self.head_size;
        if k.len() != cache || v.len() != cache {
            return Err(format!(
                "the caches must be [{}, {}, {}, {}]",
                self.num_blocks, self.block_size, self.kv_heads, self.head_size
            ));
        }
        if self.max_blocks == 0 || rows.tables.len() % self.max_blocks != 0 {
            return Err(format!("block_tables must have {} columns", self.max_blocks));
        }
        let seqs = rows.tables.len() / self.max_blocks;
        if let Some(s) = sinks {
            if s.len() != self.heads {
                return Err(format!("sinks must hold one logit per head ({}), not {}", self.heads, s.len()));
            }
        }
        for (r, (&s, &p)) in rows.seq.iter().zip(rows.pos).enumerate() {
            if s < 0 || s as usize >= seqs {
                return Err(format!("row {r} names sequence {s}, outside 0..{seqs}"));
            }
            if p < 0 || p as usize >= self.max_blocks * self.block_size {
                return Err(format!("row {r} is at position {p}, outside its block table"));
            }
            let table = &rows.tables[s as usize * self.max_blocks..][..p as usize / self.block_size + 1];
            if let Some(b) = table.iter().find(|&&b| b < 0 || b as usize >= self.num_blocks) {
                return Err(format!("row {r}'s block table names block {b}, outside 0..{}", self.num_blocks));
            }
        }
        Ok(())
    }
}

/// out [rows, heads, head_size] = each row's attention over its sequence's
/// cached positions. `q` is [rows, heads, head_size]; `sinks` one logit per
/// head that joins the softmax without a value (gpt-oss). `linger`: the
/// pool's helpers spin after the call for the next kernel (a quantized
/// step's); false where torch's threads run next (`pool::run_then_sleep`).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: KvElem>(
    layout: &Layout,
    q: &[f32],
    k: &[T],
    v: &[T],
    rows: &Rows,
    scores: Scores,
    sinks: Option<&[f32]>,
    out: &mut [f32],
    linger: bool,
) -> Result<(), String> {
    layout.check(q, k, v, rows, sinks, out)?;
    let l = *layout;
    let g = l.heads / l.kv_heads;
    let span = g * l.head_size;
    let out_ptr = SendPtr(out.as_mut_ptr());
    let run = if linger { pool::run } else { pool::run_then_sleep };
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        let groups = share_prefixes(&l, rows, scores);
        run(groups.len() * l.kv_heads, &|task| {
            let (group, kvh) = (&groups[task / l.kv_heads], task % l.kv_heads);
            let sinks = sinks.map(|s| &s[kvh * g..][..g]);
            SCRATCH.with_borrow_mut(|(w, offsets)| {
                // SAFETY: avx2() said the CPU has AVX2 and FMA; each task writes its rows'
                // `span` outputs of its kv head alone, and `out` outlives the loop
                unsafe { attend_group_avx2(&l, group, rows, kvh, scores, sinks, q, k, v, w, offsets, out_ptr) };
            });
        });
        return Ok(());
    }
    run(rows.seq.len() * l.kv_heads, &|task| {
        let (r, kvh) = (task / l.kv_heads, task % l.kv_heads);
        let at = (r * l.heads + kvh * g) * l.head_size;
        let table = &rows.tables[rows.seq[r] as usize * l.max_blocks..][..l.max_blocks];
        let head = Head { layout: &l, table, kvh, pos: rows.pos[r] as usize, scores, sinks: sinks.map(|s| &s[kvh * g..][..g]) };
        // SAFETY: each task writes its own `span` outputs, and `out` outlives the loop
        let out = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(at), span) };
        SCRATCH.with_borrow_mut(|(w, _)| head.attend(&q[at..at + span], k, v, w, out));
    });
    Ok(())
}

/// Rows whose block tables name the same blocks for their first `shared`
/// positions (a prefill chunk's rows; requests on one cached prompt): their
/// keys and values there are read once for all of them.
struct Group {
    rows: Vec<usize>,
    shared: usize,
}

/// Rows in one group at most: enough to read a shared prompt a few times a
/// step rather than once a row, small enough to give both cores tasks.
const GROUP_ROWS: usize = 16;

/// The step's rows in groups, by their first block; a sliding window gives
/// each row positions of its own, and each row a group.
fn share_prefixes(l: &Layout, rows: &Rows, scores: Scores) -> Vec<Group> {
    if scores.window.is_some() {
        return (0..rows.seq.len()).map(|r| Group { rows: vec![r], shared: 0 }).collect();
    }
    let table = |r: usize| &rows.tables[rows.seq[r] as usize * l.max_blocks..][..l.max_blocks];
    let mut by_first: Vec<Vec<usize>> = Vec::new();
    let mut index = std::collections::HashMap::new();
    for r in 0..rows.seq.len() {
        let at = *index.entry(table(r)[0]).or_insert_with(|| {
            by_first.push(Vec::new());
            by_first.len() - 1
        });
        by_first[at].push(r);
    }
    let mut groups = Vec::new();
    for same in &by_first {
        for chunk in same.chunks(GROUP_ROWS) {
            let first = table(chunk[0]);
            let seen = chunk.iter().map(|&r| rows.pos[r] as usize + 1).min().unwrap_or(0);
            let common = (0..seen.div_ceil(l.block_size)).take_while(|&b| chunk.iter().all(|&r| table(r)[b] == first[b])).count();
            groups.push(Group { rows: chunk.to_vec(), shared: (common * l.block_size).min(seen) });
        }
    }
    groups
}

/// Each position's offset in the cache for kv head `kvh`, for positions `from..to` of `table`.
fn offsets(l: &Layout, table: &[i32], kvh: usize, from: usize, to: usize, out: &mut Vec<usize>) {
    let stride = l.kv_heads * l.head_size;
    let mut p = from;
    while p < to {
        let (b, first) = (p / l.block_size, p % l.block_size);
        let base = (table[b] as usize * l.block_size * l.kv_heads + kvh) * l.head_size;
        let end = to.min((b + 1) * l.block_size);
        out.extend((first..first + end - p).map(|j| base + j * stride));
        p = end;
    }
}

/// One group's rows for one kv head, with AVX2: scores by 8-wide fused dot
/// products (four positions at a time, each reduced in the same order as one
/// alone), a vectorized exp, values by fused multiply-adds. The shared
/// positions' keys and values are read once for every row of the group, then
/// each row's own; every output is computed by operations fixed by its own
/// row alone, in position order, so a row's result is the same in any group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_group_avx2<T: KvElem>(
    l: &Layout, group: &Group, rows: &Rows, kvh: usize, scores: Scores, sinks: Option<&[f32]>,
    q: &[f32], k: &[T], v: &[T], w: &mut Vec<f32>, at: &mut Vec<usize>, out: SendPtr<f32>,
) {
    let (d, g) = (l.head_size, l.heads / l.kv_heads);
    let table = |r: usize| &rows.tables[rows.seq[r] as usize * l.max_blocks..][..l.max_blocks];
    // each row's positions first..=pos, its weights [g, n] at w[base..]
    let first = |r: usize| scores.window.map_or(0, |win| (rows.pos[r] as usize + 1).saturating_sub(win));
    let seen: Vec<(usize, usize, usize)> = group.rows.iter().scan(0, |base, &r| {
        let (f, n) = (first(r), rows.pos[r] as usize + 1 - first(r));
        *base += g * n;
        Some((f, n, *base - g * n))
    }).collect();
    w.clear();
    w.resize(seen.iter().map(|s| g * s.1).sum(), 0.0);
    // the shared positions' offsets, then each row's own
    at.clear();
    offsets(l, table(group.rows[0]), kvh, 0, group.shared, at);
    let mut own = Vec::with_capacity(group.rows.len());
    for (&r, &(f, ..)) in group.rows.iter().zip(&seen) {
        let from = at.len();
        offsets(l, table(r), kvh, group.shared.max(f), rows.pos[r] as usize + 1, at);
        own.push(from..at.len());
    }
    let qs = |x: usize| q.as_ptr().add((group.rows[x] * l.heads + kvh * g) * d);
    let outs = |x: usize| out.get().add((group.rows[x] * l.heads + kvh * g) * d);
    // weights of row x from position p on, head m at [m * n]
    let wp = w.as_mut_ptr();
    let ws = |x: usize, p: usize| {
        let (f, n, base) = seen[x];
        (wp.add(base + p - f), n)
    };
    let every = 0..group.rows.len();
    let (kp, vp) = (k.as_ptr(), v.as_ptr());
    // the values' first positions arrive while the scores are computed
    prefetch_rows(&at[..at.len().min(VALUE_CHUNK)], vp, d);
    scores_avx2(&at[..group.shared], kp, &every.clone().map(|x| (qs(x), ws(x, 0))).collect::<Vec<_>>(), g, d, scores);
    for (x, range) in own.iter().enumerate() {
        let start = group.shared.max(seen[x].0);
        scores_avx2(&at[range.clone()], kp, &[(qs(x), ws(x, start))], g, d, scores);
    }
    for (x, &(_, n, base)) in seen.iter().enumerate() {
        for m in 0..g {
            let row = std::slice::from_raw_parts_mut(wp.add(base + m * n), n);
            let sink = sinks.map(|s| s[m]);
            let max = row.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = exp_minus(row, max);
            if let Some(s) = sink {
                sum += exp8_one(s - max);
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|s| *s *= inv);
        }
        std::slice::from_raw_parts_mut(outs(x), g * d).fill(0.0);
    }
    values_avx2(&at[..group.shared], vp, &every.map(|x| (ws(x, 0), outs(x))).collect::<Vec<_>>(), g, d);
    for (x, range) in own.iter().enumerate() {
        let start = group.shared.max(seen[x].0);
        values_avx2(&at[range.clone()], vp, &[(ws(x, start), outs(x))], g, d);
    }
}

/// Scores of the keys at `at` for each target (its g query heads; its
/// weights for the first of these positions, head m `n` further on): four
/// positions at a time, for every target and head while their keys are in L1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<T: KvElem>(at: &[usize], kp: *const T, targets: &[(*const f32, (*mut f32, usize))], g: usize, d: usize, scores: Scores) {
    let body = d / 8 * 8;
    let finish = |s: f32, qm: *const f32, key: *const T| -> f32 {
        let mut s = s;
        for c in body..d {
            s += *qm.add(c) * (*key.add(c)).f32();
        }
        s *= scores.scale;
        if let Some(cap) = scores.softcap {
            s = (s / cap).tanh() * cap;
        }
        s
    };
    // every target's heads, two at a time: eight independent sums in flight
    let heads: Vec<(*const f32, *mut f32)> = targets.iter()
        .flat_map(|&(q, (w, n))| (0..g).map(move |m| (q.add(m * d), w.add(m * n))))
        .collect();
    prefetch_rows(&at[..at.len().min(AHEAD)], kp, d);
    let mut i = 0;
    while i < at.len() {
        let four = i + 4 <= at.len();
        prefetch_rows(&at[(i + AHEAD).min(at.len())..(i + AHEAD + 4).min(at.len())], kp, d);
        let keys = [0, 1, 2, 3].map(|j| kp.add(at[if four { i + j } else { i }]));
        for pair in heads.chunks(2) {
            let acc = match pair {
                [(qa, _), (qb, _)] => dots::<T, 2>([*qa, *qb], keys, body),
                _ => dots::<T, 1>([pair[0].0], keys, body),
            };
            for (h, &(qm, row)) in pair.iter().enumerate() {
                if four {
                    let sums = hsum4(acc[h]);
                    for j in 0..4 {
                        *row.add(i + j) = finish(sums[j], qm, keys[j]);
                    }
                } else {
                    *row.add(i) = finish(hsum4([acc[h][0]; 4])[0], qm, keys[0]);
                }
            }
        }
        i += if four { 4 } else { 1 };
    }
}

/// The 8-wide partial dot products of `H` query heads with four keys, each
/// summed over the columns in order (its own chain: 4·H sums in flight);
/// unused heads' sums are zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots<T: KvElem, const H: usize>(qs: [*const f32; H], keys: [*const T; 4], body: usize) -> [[__m256; 4]; 2] {
    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
    let mut c = 0;
    while c < body {
        let x: [__m256; H] = qs.map(|q| _mm256_loadu_ps(q.add(c)));
        for j in 0..4 {
            let key = T::load8(keys[j].add(c));
            for h in 0..H {
                acc[h][j] = _mm256_fmadd_ps(x[h], key, acc[h][j]);
            }
        }
        c += 8;
    }
    acc
}

/// Positions ahead whose keys are fetched while the current ones are scored.
const AHEAD: usize = 16;

/// Asks for the cache lines of the `d` elements at each offset: the positions
/// of a paged cache are scattered over blocks, which the hardware's stride
/// prefetchers follow only within a block.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn prefetch_rows<T>(at: &[usize], base: *const T, d: usize) {
    let bytes = d * std::mem::size_of::<T>();
    for &p in at {
        let row = base.add(p) as *const i8;
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(row.add(line));
        }
    }
}

/// Positions of values in L1 at a time.
const VALUE_CHUNK: usize = 32;

/// out += the weighted values at `at`, for each target (its weights for the
/// first of these positions, head m `n` further on; its g heads' outputs),
/// `VALUE_CHUNK` positions at a time; each output's sum runs in position
/// order whatever the chunks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_avx2<T: KvElem>(at: &[usize], vp: *const T, targets: &[((*mut f32, usize), *mut f32)], g: usize, d: usize) {
    let body = d / 8 * 8;
    prefetch_rows(&at[..at.len().min(VALUE_CHUNK)], vp, d);
    for (c, chunk) in at.chunks(VALUE_CHUNK).enumerate() {
        let skip = c * VALUE_CHUNK;
        prefetch_rows(&at[(skip + VALUE_CHUNK).min(at.len())..(skip + 2 * VALUE_CHUNK).min(at.len())], vp, d);
        for &((w, n), o) in targets {
            for m0 in (0..g).step_by(4) {
                let h = (g - m0).min(4);
                let rows: [*const f32; 4] = std::array::from_fn(|j| w.add((m0 + j.min(h - 1)) * n + skip) as *const f32);
                let outs: [*mut f32; 4] = std::array::from_fn(|j| o.add((m0 + j.min(h - 1)) * d));
                let (rows, outs) = (&rows[..h], &outs[..h]);
                for c0 in (0..body).step_by(16) {
                    match (h, body - c0 >= 16) {
                        (1, true) => values_tile::<T, 1, 2>(rows, outs, chunk, vp, c0),
                        (2, true) => values_tile::<T, 2, 2>(rows, outs, chunk, vp, c0),
                        (3, true) => values_tile::<T, 3, 2>(rows, outs, chunk, vp, c0),
                        (_, true) => values_tile::<T, 4, 2>(rows, outs, chunk, vp, c0),
                        (1, false) => values_tile::<T, 1, 1>(rows, outs, chunk, vp, c0),
                        (2, false) => values_tile::<T, 2, 1>(rows, outs, chunk, vp, c0),
                        (3, false) => values_tile::<T, 3, 1>(rows, outs, chunk, vp, c0),
                        (_, false) => values_tile::<T, 4, 1>(rows, outs, chunk, vp, c0),
                    }
                }
                for (&row, &out) in rows.iter().zip(outs) {
                    for c in body..d {
                        let mut x = *out.add(c);
                        for (i, &p) in chunk.iter().enumerate() {
                            x += *row.add(i) * (*vp.add(p + c)).f32();
                        }
                        *out.add(c) = x;
                    }
                }
            }
        }
    }
}

thread_local! {
    /// A task's scores, then weights: [g, positions seen]; and each position's offset in the cache.
    static SCRATCH: RefCell<(Vec<f32>, Vec<usize>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One row and one kv head: the g query heads that share it.
struct Head<'a> {
    layout: &'a Layout,
    table: &'a [i32],
    kvh: usize,
    pos: usize,
    scores: Scores,
    sinks: Option<&'a [f32]>,
}

impl Head<'_> {
    /// Where position `p`'s key (and value) for this kv head starts in the cache.
    #[inline(always)]
    fn offset(&self, p: usize) -> usize {
        let l = self.layout;
        let block = self.table[p / l.block_size] as usize;
        ((block * l.block_size + p % l.block_size) * l.kv_heads + self.kvh) * l.head_size
    }

    /// q and out: [g, head_size] of this row.
    #[inline(always)]
    fn attend<T: KvElem>(&self, q: &[f32], k: &[T], v: &[T], w: &mut Vec<f32>, out: &mut [f32]) {
        let d = self.layout.head_size;
        let g = q.len() / d;
        let first = self.scores.window.map_or(0, |win| (self.pos + 1).saturating_sub(win));
        let n = self.pos + 1 - first;
        w.clear();
        w.resize(g * n, 0.0);
        for (i, p) in (first..=self.pos).enumerate() {
            let key = &k[self.offset(p)..][..d];
            for m in 0..g {
                let mut s = dot(&q[m * d..][..d], key) * self.scores.scale;
                if let Some(cap) = self.scores.softcap {
                    s = (s / cap).tanh() * cap;
                }
                w[m * n + i] = s;
            }
        }
        for m in 0..g {
            let row = &mut w[m * n..][..n];
            let sink = self.sinks.map(|s| s[m]);
            let max = row.iter().copied().chain(sink).fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for s in row.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            if let Some(s) = sink {
                sum += (s - max).exp();
            }
            let inv = 1.0 / sum;
            row.iter_mut().for_each(|s| *s *= inv);
        }
        out.fill(0.0);
        for (i, p) in (first..=self.pos).enumerate() {
            let value = &v[self.offset(p)..][..d];
            for m in 0..g {
                axpy(w[m * n + i], value, &mut out[m * d..][..d]);
            }
        }
    }
}

/// `H` query heads' weighted sums of the values at `at`, added to their
/// outputs for the `8·W` columns from `c0`: out[h][c] += weights[h][i] ·
/// value_i[c], in position order (so a column's sum is the same whichever
/// heads, columns and positions share its tile).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn values_tile<T: KvElem, const H: usize, const W: usize>(
    weights: &[*const f32], outs: &[*mut f32], at: &[usize], vp: *const T, c0: usize,
) {
    let mut acc: [[__m256; W]; H] = std::array::from_fn(|h| std::array::from_fn(|c| _mm256_loadu_ps(outs[h].add(c0 + 8 * c))));
    for (i, &p) in at.iter().enumerate() {
        let value = vp.add(p + c0);
        let x: [__m256; W] = std::array::from_fn(|c| T::load8(value.add(8 * c)));
        for h in 0..H {
            let a = _mm256_set1_ps(*weights[h].add(i));
            for c in 0..W {
                acc[h][c] = _mm256_fmadd_ps(a, x[c], acc[h][c]);
            }
        }
    }
    for h in 0..H {
        for c in 0..W {
            _mm256_storeu_ps(outs[h].add(c0 + 8 * c), acc[h][c]);
        }
    }
}

const LANES: usize = 16;

/// Σ a·b, in LANES partial sums (so it vectorizes), then those in a fixed order.
#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    let mut acc = [0f32; LANES];
    let (a_body, a_tail) = a.split_at(a.len() / LANES * LANES);
    let (b_body, b_tail) = b.split_at(a_body.len());
    for (x, y) in a_body.chunks_exact(LANES).zip(b_body.chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i].f32();
        }
    }
    for (i, (x, y)) in a_tail.iter().zip(b_tail).enumerate() {
        acc[i] += x * y.f32();
    }
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] += acc[i + width];
        }
    }
    acc[0]
}

/// out += a · x
#[inline(always)]
fn axpy<T: KvElem>(a: f32, x: &[T], out: &mut [f32]) {
    for (o, x) in out.iter_mut().zip(x) {
        *o += a * x.f32();
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn layout(heads: usize, kv_heads: usize, d: usize, blocks: usize, bs: usize, max_blocks: usize) -> Layout {
        Layout { heads, kv_heads, head_size: d, num_blocks: blocks, block_size: bs, max_blocks }
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2000) as f32 / 1000.0 - 1.0).collect()
    }

    /// The straightforward formula, one row and head at a time, in f64.
    fn naive(l: &Layout, q: &[f32], k: &[f32], v: &[f32], rows: &Rows, s: Scores, sinks: Option<&[f32]>) -> Vec<f32> {
        let (d, g) = (l.head_size, l.heads / l.kv_heads);
        let mut out = vec![0f32; q.len()];
        for r in 0..rows.seq.len() {
            let table = &rows.tables[rows.seq[r] as usize * l.max_blocks..];
            let pos = rows.pos[r] as usize;
            let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            for h in 0..l.heads {
                let at = |p: usize| ((table[p / l.block_size] as usize * l.block_size + p % l.block_size) * l.kv_heads + h / g) * d;
                let qh = &q[(r * l.heads + h) * d..][..d];
                let mut logits: Vec<f64> = (first..=pos)
                    .map(|p| {
                        let x: f64 = qh.iter().zip(&k[at(p)..][..d]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * s.scale as f64;
                        s.softcap.map_or(x, |c| (x / c as f64).tanh() * c as f64)
                    })
                    .collect();
                let sink = sinks.map(|s| s[h] as f64);
                let max = logits.iter().copied().chain(sink).fold(f64::NEG_INFINITY, f64::max);
                logits.iter_mut().for_each(|x| *x = (*x - max).exp());
                let total: f64 = logits.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for e in 0..d {
                    let acc: f64 = (first..=pos).zip(&logits).map(|(p, w)| w * v[at(p) + e] as f64).sum();
                    out[(r * l.heads + h) * d + e] = (acc / total) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_formula_with_windows_caps_and_sinks() {
        let l = layout(6, 2, 40, 9, 4, 5);
        let cache = l.num_blocks * l.block_size * l.kv_heads * l.head_size;
        let (k, v) = (values(cache, 1), values(cache, 2));
        // two sequences on scattered blocks: rows of a prefill chunk and a decode
        let tables = [3, 7, 1, 0, 5, 8, 2, 6, 4, 0];
        let rows = Rows { tables: &tables, seq: &[0, 0, 0, 1], pos: &[9, 10, 11, 16] };
        let q = values(4 * l.heads * l.head_size, 3);
        let sinks = values(l.heads, 4);
        for (scores, sinks) in [
            (Scores { scale: 0.15, window: None, softcap: None }, None),
            (Scores { scale: 0.15, window: Some(5), softcap: None }, None),
            (Scores { scale: 0.6, window: None, softcap: Some(2.0) }, Some(&sinks[..])),
        ] {
            let mut out = vec![0f32; q.len()];
            paged_attention(&l, &q, &k, &v, &rows, scores, sinks, &mut out, true).unwrap();
            let want = naive(&l, &q, &k, &v, &rows, scores, sinks);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-5, "{scores:?}: {a} vs {b}");
            }
        }
    }

    /// A row's output is bit-for-bit the same alone and among other rows,
    /// whatever the other rows' lengths (what batch invariance rests on).
    #[test]
    fn a_row_is_the_same_alone_and_in_a_batch() {
        let l = layout(4, 4, 64, 12, 16, 6);
        let cache = l.num_blocks * l.block_size * l.kv_heads * l.head_size;
        let (k, v) = (values(cache, 5), values(cache, 6));
        let tables = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];
        let q = values(3 * l.heads * l.head_size, 7);
        let s = Scores { scale: 0.125, window: None, softcap: None };
        let mut batch = vec![0f32; q.len()];
        paged_attention(&l, &q, &k, &v, &Rows { tables: &tables, seq: &[0, 1, 0], pos: &[40, 95, 41] }, s, None, &mut batch, false).unwrap();
        let span = l.heads * l.head_size;
        let mut alone = vec![0f32; span];
        paged_attention(&l, &q[span..2 * span], &k, &v, &Rows { tables: &tables, seq: &[1], pos: &[95] }, s, None, &mut alone, true).unwrap();
        assert_eq!(alone, batch[span..2 * span]);
    }

    /// Rows on one cached prompt read its keys and values once for the group
    /// (share_prefixes); each row's result is still the one it has alone, and the formula's.
    #[test]
    fn rows_sharing_a_prompt_are_each_as_alone() {
        let l = layout(6, 2, 72, 40, 4, 8);
        let cache = l.num_blocks * l.block_size * l.kv_heads * l.head_size;
        let (k, v) = (values(cache, 8), values(cache, 9));
        // six sequences: three on one prompt of 3 blocks (one parting after 1), two on
        // another, one alone; each with blocks of its own after
        let prompt = [0, 1, 2];
        let mut tables = Vec::new();
        for (i, shared) in [&prompt[..], &prompt[..], &prompt[..1], &[3, 4][..], &[3, 4][..], &[][..]].iter().enumerate() {
            let own = (0..l.max_blocks - shared.len()).map(|j| (5 + i * 5 + j) as i32 % l.num_blocks as i32);
            tables.extend(shared.iter().map(|&b| b as i32).chain(own));
        }
        // 40 rows (more than a group holds): decodes and a prefill chunk's rows, in no order
        let seq: Vec<i32> = (0..40).map(|r| (r * 7 % 6) as i32).collect();
        let pos: Vec<i32> = (0..40).map(|r| 5 + (r * 13 % 26) as i32).collect();
        let q = values(seq.len() * l.heads * l.head_size, 10);
        let sinks = values(l.heads, 11);
        let span = l.heads * l.head_size;
        for (s, sinks) in [
            (Scores { scale: 0.12, window: None, softcap: None }, None),
            (Scores { scale: 0.12, window: Some(6), softcap: None }, None),
            (Scores { scale: 0.5, window: None, softcap: Some(3.0) }, Some(&sinks[..])),
        ] {
            let rows = Rows { tables: &tables, seq: &seq, pos: &pos };
            let mut batch = vec![0f32; q.len()];
            paged_attention(&l, &q, &k, &v, &rows, s, sinks, &mut batch, true).unwrap();
            let want = naive(&l, &q, &k, &v, &rows, s, sinks);
            assert!(batch.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4), "{s:?}");
            for r in 0..seq.len() {
                let mut alone = vec![0f32; span];
                let one = Rows { tables: &tables, seq: &seq[r..r + 1], pos: &pos[r..r + 1] };
                paged_attention(&l, &q[r * span..][..span], &k, &v, &one, s, sinks, &mut alone, true).unwrap();
                assert_eq!(alone, batch[r * span..][..span], "row {r}, {s:?}");
            }
        }
    }

    #[test]
    fn bf16_caches_read_as_their_f32_values() {
        let l = layout(2, 1, 16, 2, 4, 2);
        let cache = l.num_blocks * l.block_size * l.kv_heads * l.head_size;
        let bf: Vec<u16> = values(cache, 8).iter().map(|x| (x.to_bits() >> 16) as u16).collect();
        let widened: Vec<f32> = bf.iter().map(|b| b.f32()).collect();
        let rows = Rows { tables: &[1, 0], seq: &[0], pos: &[6] };
        let q = values(l.heads * l.head_size, 9);
        let s = Scores { scale: 0.25, window: None, softcap: None };
        let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        paged_attention(&l, &q, &bf, &bf, &rows, s, None, &mut a, true).unwrap();
        paged_attention(&l, &q, &widened, &widened, &rows, s, None, &mut b, true).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bad_calls_are_refused_with_their_reason() {
        let l = layout(2, 1, 8, 2, 4, 2);
        let cache = vec![0f32; 2 * 4 * 8];
        let q = vec![0f32; 2 * 8];
        let mut out = vec![0f32; 2 * 8];
        let s = Scores { scale: 1.0, window: None, softcap: None };
        let err = |tables: &[i32], seq: &[i32], pos: &[i32], out: &mut [f32]| {
            paged_attention(&l, &q, &cache, &cache, &Rows { tables, seq, pos }, s, None, out, true).unwrap_err()
        };
        assert!(err(&[0, 5], &[0], &[6], &mut out).contains("block 5"));
        assert!(err(&[0, 1], &[0], &[8], &mut out).contains("position 8"));
        assert!(err(&[0, 1], &[1], &[0], &mut out).contains("sequence 1"));
        assert!(err(&[0, 1], &[0], &[0], &mut out[..8]).contains("q and out"));
    }
}
