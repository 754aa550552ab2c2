//! Quantized weights repacked for multi-row kernels, and the kernels.
//!
//! A GGUF stores a weight matrix row by row in 32- or 256-column blocks. For
//! the CPU step every block format with a packing here is rewritten once, at
//! load, into 4-bit values (Q4_0, Q4_1, Q4_K), 4-bit values with the bits
//! above them in planes apart (Q5_0, Q5_1, Q5_K; Q6_K: `high_bits`) or 8-bit
//! values (Q8_0), each with a scale per 32 columns (two for Q6_K's 16-column
//! scales) and an offset where the format has one, so that every weight is
//! `d·q + m` exactly as ggml dequantizes it (`tests`: bit for bit). The
//! K-quants keep their 6- and 8-bit scales, times their super-block's scale
//! in the kernel (`Packing::half`), so a packed matrix takes about the bytes
//! of its GGUF tensor, which a batch-1 step reads whole. Eight weight rows are interleaved
//! per block — a 32-bit lane of a 256-bit register holds four values of one
//! row — so a kernel broadcasts four activation values to every lane and one
//! integer multiply-add serves eight rows. Each block of eight rows is loaded
//! once per call and multiplied with every activation row of the call, where
//! a one-row dot product (ggml's `vec_dot`) reads it once per activation row.
//!
//! Activations are quantized per 32 columns to 8 bits (`Activations`, as
//! llama.cpp's Q8_0/Q8_1). An output is then, block by block, an exact
//! integer dot product scaled in f32 by the same operations in the same
//! order whatever the number of rows in the call, the tile a row falls in,
//! or the ISA (AVX2's `maddubs` and AVX-512 VNNI's `dpbusd` give the same
//! integers): a row's result never depends on its batch (issue 38's
//! one-request-one-answer).

pub use crate::cpu::activations::BLOCK;
use crate::cpu::activations::Activations;
pub use crate::cpu::simd::{isa, Isa};
use crate::threads::pool::{self, SendPtr};

use std::sync::Arc;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Weight rows interleaved per block.
pub const LANES: usize = 8;

/// How a packed matrix stores a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packing {
    /// 4-bit unsigned values (else 8-bit signed)
    nibbles: bool,
    /// with `nibbles`, bits of each value above its nibble, in planes after
    /// them (`high_bits`): 0; 1 (Q5: 5-bit unsigned values, with an
    /// offset); or 2 (Q6_K: 6-bit values less 32, signed). A Q5 value then
    /// takes 6 bits and a Q6_K value 6.6, where a byte would take 8.5
    high: usize,
    /// scales per row and block: 1, or 2 (one per 16 columns)
    subs: usize,
    /// a per-row, per-block offset: w = d·q + m
    min: bool,
    /// scales and offsets as f16 (the source's own, kept exactly); else (the
    /// K-quants) as the source's own 6- or 8-bit integers, each times its
    /// lane's f32 scale (offsets: the negated offset scale) of the 256-column
    /// super-block, in a table after the records (`super_bytes`): the
    /// product ggml's dequantization forms, exact in f32
    half: bool,
}

impl Packing {
    fn scale_bytes(self) -> usize {
        if self.half {
            2
        } else {
            1
        }
    }
    /// Bytes of one group's super-block scales (per eight blocks): each lane's scale, and offset scale.
    fn super_bytes(self) -> usize {
        if self.half {
            0
        } else {
            LANES * 4 * (1 + self.min as usize)
        }
    }
    /// Bytes of a [rows, blocks · 32] matrix: its records, then its super-block scales.
    fn matrix_bytes(self, rows: usize, blocks: usize) -> usize {
        rows.div_ceil(LANES) * (blocks * self.record() + blocks.div_ceil(8) * self.super_bytes())
    }
    fn mins_at(self) -> usize {
        LANES * self.subs * self.scale_bytes()
    }
    fn quants_at(self) -> usize {
        self.mins_at() + if self.min { LANES * self.scale_bytes() } else { 0 }
    }
    /// Where the planes of high bits start (`high_bits`).
    fn planes_at(self) -> usize {
        self.quants_at() + LANES * BLOCK / 2
    }
    /// Bytes of one block of eight rows.
    fn record(self) -> usize {
        self.quants_at() + if self.nibbles { LANES * BLOCK / 2 + 32 * self.high } else { LANES * BLOCK }
    }
}

/// Where the high bits of a value in a block's nibbles are: the nibbles are
/// eight 32-byte vectors (`nibbles`: chunk j's low nibbles are vector 2j,
/// its high ones 2j + 1), and byte k of a 32-byte plane holds the high bits
/// of byte k of 8 / `high` vectors, vector v's at bit (v mod 8/high)·high of
/// plane v / (8/high). So a kernel gets vector v's high bits in place (bit 4
/// up) with one shift and one mask, on AVX2 as on AVX-512.
fn high_bits(high: usize, v: usize) -> (usize, usize) {
    let per = 8 / high;
    (32 * (v / per), (v % per) * high)
}

/// The ggml formats with a packing: type id and how it packs.
fn packing_of(ty: u32) -> Option<Packing> {
    let p = |nibbles, high, subs, min, half| Some(Packing { nibbles, high, subs, min, half });
    match ty {
        2 => p(true, 0, 1, true, true),    // Q4_0: q - 8 as q with m = -8d
        3 => p(true, 0, 1, true, true),    // Q4_1
        6 => p(true, 1, 1, true, true),    // Q5_0: q - 16 as q with m = -16d
        7 => p(true, 1, 1, true, true),    // Q5_1
        8 => p(false, 0, 1, false, true),  // Q8_0
        12 => p(true, 0, 1, true, false),  // Q4_K: d·sc and -dmin·m per 32 columns
        13 => p(true, 1, 1, true, false),  // Q5_K
        14 => p(true, 2, 2, false, false), // Q6_K: d·sc per 16 columns
        _ => None,
    }
}

/// One 32-column block of one row, decoded from a ggml block: values, and
/// the scale(s) and offset as the packing stores them (f16 bits, or the
/// K-quants' integers with their super-block's scale and negated offset scale).
struct Decoded {
    q: [i8; BLOCK],
    scales: [u32; 2],
    min: u32,
    sup: [f32; 2],
}

/// A weight matrix [rows, cols] in a packed layout: for each group of eight
/// rows, for each block, a record of scales, offsets and values.
/// A packed matrix's records: packed in this process, or a slice of a load-cache file
/// (model/pack_cache.py) mapped read-only, its pages shared with the page cache as a
/// GGUF's are in llama.cpp. Cache files are only ever replaced by a rename, never written in
/// place, so a mapping stays whole.
pub enum Records {
    Owned(Vec<u8>),
    Mapped(Arc<memmap2::Mmap>, std::ops::Range<usize>),
}

impl std::ops::Deref for Records {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Records::Owned(v) => v,
            Records::Mapped(map, range) => &map[range.clone()],
        }
    }
}

impl Records {
    /// `len` bytes of `map` from `offset`, where the map has them.
    pub fn mapped(map: &Arc<memmap2::Mmap>, offset: usize, len: usize) -> Result<Records, String> {
        match offset.checked_add(len) {
            Some(end) if end <= map.len() => Ok(Records::Mapped(map.clone(), offset..end)),
            _ => Err(format!("{len} bytes from {offset} run past the end of a {}-byte file", map.len())),
        }
    }
}

/// Each of `records` written to a new file at `path` from a multiple of 64 bytes: (offset,
/// length) of each, as `Records::mapped` takes them.
pub fn write_records<'a>(path: &std::path::Path, records: impl Iterator<Item = &'a [u8]>) -> std::io::Result<Vec<(usize, usize)>> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    let (mut at, mut out) = (0, Vec::new());
    for r in records {
        let pad = r.len().next_multiple_of(64) - r.len();
        file.write_all(r)?;
        file.write_all(&[0u8; 64][..pad])?;
        out.push((at, r.len()));
        at += r.len() + pad;
    }
    file.sync_data()?;
    Ok(out)
}

/// A file of packed records (a load-cache entry), mapped read-only.
pub fn map_file(path: &std::path::Path) -> std::io::Result<Arc<memmap2::Mmap>> {
    let file = std::fs::File::open(path)?;
    // SAFETY: the cache writes a new file and renames it over an entry, never writing in place
    Ok(Arc::new(unsafe { memmap2::Mmap::map(&file)? }))
}

pub struct PackedMatrix {
    packing: Packing,
    pub rows: usize,
    pub cols: usize,
    blocks: usize,
    data: Records,
    /// each row's ‖w‖₁ per 32-column block, for the precise product's bound (`refine`)
    norms: std::sync::OnceLock<BlockNorms>,
}

/// A matrix's rows' ‖w_j,k‖₁ per 32-column block k ([rows, blocks]), and per row
/// ‖(‖w_j,k‖₁)_k‖₂ (a bound of the first's dot product with any vector, by its norm).
struct BlockNorms {
    l1: Vec<f32>,
    l2: Vec<f32>,
}

impl PackedMatrix {
    /// Whether ggml type `ty` has a packing.
    pub fn packs(ty: u32) -> bool {
        packing_of(ty).is_some()
    }

    /// `data`: the ggml rows of a [rows, cols] matrix in format `ty` (whose
    /// sizes the caller checked). None where the format has no packing, or a
    /// value cannot be kept exactly (a Q4_0 scale whose -8·d overflows f16).
    pub fn pack(ty: u32, rows: usize, cols: usize, data: &[u8], row_bytes: usize) -> Option<PackedMatrix> {
        let packing = packing_of(ty)?;
        if cols % 256 != 0 && matches!(ty, 12..=14) {
            return None;
        }
        let blocks = cols / BLOCK;
        let groups = rows.div_ceil(LANES);
        let record = packing.record();
        let mut out = vec![0u8; packing.matrix_bytes(rows, blocks)];
        let supers = groups * blocks * record;
        let sup_group = blocks.div_ceil(8) * packing.super_bytes();
        let ok = std::sync::atomic::AtomicBool::new(true);
        let out_ptr = SendPtr(out.as_mut_ptr());
        pool::run(groups, &|g| {
            for lane in 0..LANES.min(rows - g * LANES) {
                let r = g * LANES + lane;
                let row = &data[r * row_bytes..][..row_bytes];
                for b in 0..blocks {
                    let Some(dec) = decode(ty, row, b) else {
                        ok.store(false, std::sync::atomic::Ordering::Relaxed);
                        return;
                    };
                    // SAFETY: each (group, block) record, and each group's super-block scales,
                    // are written by this task only
                    let rec = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((g * blocks + b) * record), record) };
                    let sup = unsafe {
                        std::slice::from_raw_parts_mut(out_ptr.get().add(supers + g * sup_group + b / 8 * packing.super_bytes()), packing.super_bytes())
                    };
                    write_lane(packing, rec, sup, lane, &dec);
                }
            }
        });
        ok.into_inner().then_some(PackedMatrix { packing, rows, cols, blocks, data: Records::Owned(out), norms: Default::default() })
    }

    /// A packing `pack` made earlier (its `bytes()`, kept in the load cache): None where `data`
    /// is not the size that packing of a [rows, cols] matrix of format `ty` has.
    pub fn from_packed(ty: u32, rows: usize, cols: usize, data: Records) -> Option<PackedMatrix> {
        let packing = packing_of(ty)?;
        let blocks = cols / BLOCK;
        let whole = cols % BLOCK == 0 && !(cols % 256 != 0 && matches!(ty, 12..=14));
        (whole && data.len() == packing.matrix_bytes(rows, blocks))
            .then_some(PackedMatrix { packing, rows, cols, blocks, data, norms: Default::default() })
    }

    /// The packed records, as `from_packed` takes them back.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub fn nbytes(&self) -> usize {
        self.data.len()
    }

    fn record(&self) -> usize {
        self.packing.record()
    }

    /// Group `g`'s super-block scales (empty where the scales are f16).
    fn supers(&self, g: usize) -> &[u8] {
        let per = self.blocks.div_ceil(8) * self.packing.super_bytes();
        &self.data[self.rows.div_ceil(LANES) * self.blocks * self.record() + g * per..][..per]
    }

    /// Block `b` of group `g`: its record, and its super-block's scales.
    fn block(&self, g: usize, b: usize) -> (&[u8], &[u8]) {
        let sb = self.packing.super_bytes();
        (&self.data[(g * self.blocks + b) * self.record()..][..self.record()], &self.supers(g)[b / 8 * sb..][..sb])
    }

    /// Row `r` as f32, by the operations ggml's dequantization does (the same values, bit for bit).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let p = self.packing;
        let (g, lane) = (r / LANES, r % LANES);
        for b in 0..self.blocks {
            let (rec, sup) = self.block(g, b);
            let (scales, min) = lane_scales(p, rec, sup, lane);
            for i in 0..BLOCK {
                let d = scales[i * p.subs / BLOCK];
                let q = read_quant(p, rec, lane, i) as f32;
                out[b * BLOCK + i] = if p.min { q * d + min } else { q * d };
            }
        }
    }

    /// out [batch, self.rows] = the activations times this matrix's rows.
    ///
    /// With `act.precise` (the output head), each output first gets its 8-bit
    /// product; then, row by row, the outputs that could be that row's largest
    /// once the residual row is added get it added. Output j's residual product
    /// is at most B_j = Σ_k R_k·‖w_j,k‖₁ (R_k the largest value the residual
    /// row holds in block k, ‖w_j,k‖₁ the row's block), so an output with
    /// p_j + B_j below max(p − B) is left as it is, its precise value below
    /// another's. The groups of eight rows refined are the same whatever else
    /// the batch holds, and a refined output has the full second pass's bits:
    /// the top of every row, so its greedy token, is the full second pass's.
    pub fn matmul(&self, act: &Activations, out: &mut [f32]) {
        self.matmul_with(kernel_for(self.packing, isa()), act, out)
    }

    fn matmul_with(&self, kernel: Kernel, act: &Activations, out: &mut [f32]) {
        assert_eq!(act.cols, self.cols, "packed matmul: activation width");
        let batch = act.batch();
        assert_eq!(out.len(), batch * self.rows, "packed matmul: output shape");
        let stride = if act.precise { 2 } else { 1 };
        self.product(kernel, act, stride, out);
        if act.precise {
            self.refine(kernel, act, out);
        }
    }

    /// out [batch, rows] = activation rows 0, stride, 2·stride, … times every weight row.
    fn product(&self, kernel: Kernel, act: &Activations, stride: usize, out: &mut [f32]) {
        let rows_per_call = kernel.rows;
        let groups = self.rows.div_ceil(LANES);
        let arows = act.rows / stride;
        // tasks: a range of groups × a range of activation rows (whose quantized rows stay in cache)
        let row_chunk = if arows <= 64 { arows } else { 32 };
        let row_chunks = arows.div_ceil(row_chunk);
        let per = (groups * row_chunks).div_ceil(4 * pool::threads()).max(1);
        let group_chunk = per.min(groups).max(if row_chunks > 1 { 1 } else { 2.min(groups) });
        let group_chunks = groups.div_ceil(group_chunk);
        let target = SendPtr(out.as_mut_ptr());
        pool::run(group_chunks * row_chunks, &|task| {
            let (gc, rc) = (task % group_chunks, task / group_chunks);
            let target = target;
            let mut spare = [[0f32; LANES]; MAX_ROWS];
            let (mut g, last) = (gc * group_chunk, ((gc + 1) * group_chunk).min(groups));
            while g < last {
                let full = (g + 1) * LANES <= self.rows;
                // with the next group too, where the kernel takes two, both are whole and the call
                // has two activation rows or more (one row's call reads its weights faster eight
                // rows at a time: 70 against 53 GB/s on SmolLM2's gate_up, AVX-512 EPYC)
                let pair = kernel.pair.filter(|_| g + 1 < last && (g + 2) * LANES <= self.rows && arows > 1);
                let mut r0 = rc * row_chunk;
                let end = ((rc + 1) * row_chunk).min(arows);
                while r0 < end {
                    let n = rows_per_call.min(end - r0);
                    let mut tile = self.tile(g);
                    for i in 0..n {
                        let r = r0 + i;
                        self.take_row(&mut tile, i, act, r * stride);
                        // SAFETY: (row r, group g) outputs are this task's alone
                        tile.out[i] = if full { unsafe { target.get().add(r * self.rows + g * LANES) } } else { spare[i].as_mut_ptr() };
                    }
                    // SAFETY: the kernel was picked for this CPU; every pointer covers `blocks` blocks
                    // (of two groups for a pair, whose outputs are the next eight of each row)
                    unsafe { (pair.unwrap_or(kernel.run))(&tile, n) };
                    if !full {
                        for (i, lanes) in spare.iter().enumerate().take(n) {
                            let at = (r0 + i) * self.rows + g * LANES;
                            for (l, &v) in lanes.iter().enumerate().take(self.rows - g * LANES) {
                                // SAFETY: as above
                                unsafe { *target.get().add(at + l) = v };
                            }
                        }
                    }
                    r0 += n;
                }
                g += if pair.is_some() { 2 } else { 1 };
            }
        });
    }

    /// The precise pass where it can matter (see `matmul`): for each input row b, the
    /// residual row 2b+1's product added to the groups that could hold b's largest output.
    fn refine(&self, kernel: Kernel, act: &Activations, out: &mut [f32]) {
        let (norms, blocks, rows) = (self.block_norms(), self.blocks, self.rows);
        let batch = out.len() / rows;
        let mut chosen: Vec<Vec<usize>> = vec![Vec::new(); batch];
        let slots = SendPtr(chosen.as_mut_ptr());
        let outs = &*out;
        pool::run(batch, &|b| {
            let slots = slots;
            // the residual row's largest value per block (127·d bounds |q·d|), 1% to spare for
            // the sums' rounding, and the bound of output j's residual product it gives
            let reach: Vec<f32> = (0..blocks).map(|k| act.d[(2 * b + 1) * blocks + k] * 127.0 * 1.01).collect();
            let bound = |j: usize| -> f32 { norms.l1[j * blocks..][..blocks].iter().zip(&reach).map(|(w, r)| w * r).sum() };
            // ≤ bound(j) by Cauchy-Schwarz, one product per output
            let reach2 = reach.iter().map(|r| r * r).sum::<f32>().sqrt() * 1.01;
            let p = &outs[b * rows..][..rows];
            let top = (0..rows).fold(0, |t, j| if p[j] > p[t] { j } else { t });
            // at most the largest precise output
            let floor = p[top] - bound(top);
            let mut groups = Vec::new();
            for j in 0..rows {
                if p[j] + reach2 * norms.l2[j] >= floor && p[j] + bound(j) >= floor && groups.last() != Some(&(j / LANES)) {
                    groups.push(j / LANES);
                }
            }
            // SAFETY: slot b is this task's alone
            unsafe { *slots.get().add(b) = groups };
        });
        let work: Vec<(usize, usize)> = chosen.iter().enumerate().flat_map(|(b, gs)| gs.iter().map(move |&g| (b, g))).collect();
        let target = SendPtr(out.as_mut_ptr());
        pool::run(work.len(), &|w| {
            let (b, g) = work[w];
            let target = target;
            let mut lanes = [0f32; LANES];
            let mut tile = self.tile(g);
            self.take_row(&mut tile, 0, act, 2 * b + 1);
            tile.out[0] = lanes.as_mut_ptr();
            // SAFETY: as in `product`
            unsafe { (kernel.run)(&tile, 1) };
            for (l, &v) in lanes.iter().enumerate().take(rows - g * LANES) {
                // SAFETY: each (b, g) is one task's, its outputs no other's
                unsafe { *target.get().add(b * rows + g * LANES + l) += v };
            }
        });
    }

    /// ‖w_j,k‖₁ of every row j's every 32-column block k, as dequantized ([rows, blocks]), and
    /// per row the Euclidean norm of those (computed once, at the first precise product).
    fn block_norms(&self) -> &BlockNorms {
        self.norms.get_or_init(|| {
            let mut l1 = vec![0f32; self.rows * self.blocks];
            let mut l2 = vec![0f32; self.rows];
            let (at, at2) = (SendPtr(l1.as_mut_ptr()), SendPtr(l2.as_mut_ptr()));
            pool::run(self.rows.div_ceil(256), &|c| {
                let (at, at2) = (at, at2);
                let p = self.packing;
                for r in c * 256..((c + 1) * 256).min(self.rows) {
                    let (g, lane) = (r / LANES, r % LANES);
                    let mut squares = 0f32;
                    for k in 0..self.blocks {
                        // the values as dequantize_row has them (d·q + m), the scales read once a block
                        let (rec, sup) = self.block(g, k);
                        let (scales, min) = lane_scales(p, rec, sup, lane);
                        let mut n = 0f32;
                        for (sub, &d) in scales.iter().enumerate().take(p.subs) {
                            for i in sub * BLOCK / p.subs..(sub + 1) * BLOCK / p.subs {
                                let q = read_quant(p, rec, lane, i) as f32;
                                n += (if p.min { q * d + min } else { q * d }).abs();
                            }
                        }
                        squares += n * n;
                        // SAFETY: row r is this task's alone
                        unsafe { *at.get().add(r * self.blocks + k) = n };
                    }
                    // SAFETY: as above
                    unsafe { *at2.get().add(r) = squares.sqrt() };
                }
            });
            BlockNorms { l1, l2 }
        })
    }

    fn tile(&self, g: usize) -> Tile {
        let null = std::ptr::null();
        Tile {
            rec: self.data[g * self.blocks * self.record()..].as_ptr(),
            record: self.record(),
            sup: self.supers(g).as_ptr(),
            super_bytes: self.packing.super_bytes(),
            blocks: self.blocks,
            q: [null; MAX_ROWS],
            u: [std::ptr::null(); MAX_ROWS],
            d: [std::ptr::null(); MAX_ROWS],
            s: [std::ptr::null(); MAX_ROWS],
            out: [std::ptr::null_mut(); MAX_ROWS],
        }
    }

    /// Activation row `r` as the tile's i-th row.
    fn take_row(&self, tile: &mut Tile, i: usize, act: &Activations, r: usize) {
        tile.q[i] = act.q[r * act.cols..].as_ptr();
        if !act.u.is_empty() {
            tile.u[i] = act.u[r * act.cols..].as_ptr();
        }
        tile.d[i] = act.d[r * self.blocks..].as_ptr();
        tile.s[i] = act.s[r * self.blocks..].as_ptr();
    }
}

/// One 32-column block `b` of a ggml row, as values with their scales.
fn decode(ty: u32, row: &[u8], b: usize) -> Option<Decoded> {
    let h = |at: usize| u16::from_le_bytes([row[at], row[at + 1]]) as u32;
    let mut q = [0i8; BLOCK];
    let mut scales = [0u32; 2];
    let mut min = 0;
    let mut sup = [0f32; 2];
    match ty {
        2 | 3 => {
            let size = if ty == 2 { 18 } else { 20 };
            let blk = &row[b * size..][..size];
            let qs = &blk[size - 16..];
            for j in 0..16 {
                q[j] = (qs[j] & 0x0F) as i8;
                q[j + 16] = (qs[j] >> 4) as i8;
            }
            scales[0] = h(b * size);
            min = if ty == 3 { h(b * size + 2) } else { f32_to_f16_exact(-8.0 * f16_to_f32(scales[0] as u16))? as u32 };
        }
        6 | 7 => {
            let size = if ty == 6 { 22 } else { 24 };
            let blk = &row[b * size..][..size];
            let hat = if ty == 6 { 2 } else { 4 };
            let qh = u32::from_le_bytes([blk[hat], blk[hat + 1], blk[hat + 2], blk[hat + 3]]);
            let qs = &blk[hat + 4..];
            for j in 0..16 {
                let h0 = ((qh >> j) << 4) & 0x10;
                let h1 = (qh >> (j + 12)) & 0x10;
                q[j] = (qs[j] as u32 & 0x0F | h0) as i8;
                q[j + 16] = (qs[j] as u32 >> 4 | h1) as i8;
            }
            scales[0] = h(b * size);
            min = if ty == 7 { h(b * size + 2) } else { f32_to_f16_exact(-16.0 * f16_to_f32(scales[0] as u16))? as u32 };
        }
        8 => {
            let blk = &row[b * 34..][..34];
            for j in 0..BLOCK {
                q[j] = blk[2 + j] as i8;
            }
            scales[0] = h(b * 34);
        }
        12 | 13 => {
            // 256-column super-blocks of eight 32-column blocks
            let size = if ty == 12 { 144 } else { 176 };
            let (sb, sub) = (b / 8, b % 8);
            let blk = &row[sb * size..][..size];
            let d = f16_to_f32(u16::from_le_bytes([blk[0], blk[1]]));
            let dmin = f16_to_f32(u16::from_le_bytes([blk[2], blk[3]]));
            let (sc, m) = scale_min_k4(sub, &blk[4..16]);
            // as ggml: d1 = d·sc, m1 = dmin·m, w = d1·q - m1 (-m1 = (-dmin)·m, exactly)
            (scales[0], min, sup) = (sc as u32, m as u32, [d, -dmin]);
            let (qs, pair, high) = if ty == 12 { (&blk[16..], sub / 2, sub % 2 == 1) } else { (&blk[48..], sub / 2, sub % 2 == 1) };
            for l in 0..BLOCK {
                let byte = qs[pair * 32 + l];
                let mut v = if high { byte >> 4 } else { byte & 0x0F } as i32;
                if ty == 13 {
                    let qh = blk[16 + l];
                    if qh & (1 << sub) != 0 {
                        v += 16;
                    }
                }
                q[l] = v as i8;
            }
        }
        14 => {
            let blk = &row[(b / 8) * 210..][..210];
            let (ql, qh, sc) = (&blk[..128], &blk[128..192], &blk[192..208]);
            let d = f16_to_f32(u16::from_le_bytes([blk[208], blk[209]]));
            // element e of the super-block: half n (128 each), then l in 0..32 and quarter k in 0..4
            let sub = b % 8;
            let (n, k) = (sub / 4, sub % 4);
            for l in 0..BLOCK {
                let lo = ql[n * 64 + l + if k % 2 == 1 { 32 } else { 0 }];
                let lo = if k >= 2 { lo >> 4 } else { lo & 0x0F };
                let hi = (qh[n * 32 + l] >> (2 * k)) & 3;
                q[l] = (lo | hi << 4) as i8; // less 32 where read (`read_quant`, the kernels)
            }
            for (i, s) in scales.iter_mut().enumerate() {
                *s = sc[n * 8 + 2 * k + i] as u32;
            }
            sup[0] = d;
        }
        _ => return None,
    }
    Some(Decoded { q, scales, min, sup })
}

/// ggml's get_scale_min_k4: the 6-bit scale and offset of sub-block `j` of a K-quant super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

fn write_lane(p: Packing, rec: &mut [u8], sup: &mut [u8], lane: usize, dec: &Decoded) {
    let sb = p.scale_bytes();
    for (i, v) in dec.sup.iter().enumerate().take(sup.len() / (4 * LANES)) {
        sup[(i * LANES + lane) * 4..][..4].copy_from_slice(&v.to_le_bytes());
    }
    for s in 0..p.subs {
        let at = (s * LANES + lane) * sb;
        rec[at..at + sb].copy_from_slice(&dec.scales[s].to_le_bytes()[..sb]);
    }
    if p.min {
        let at = p.mins_at() + lane * sb;
        rec[at..at + sb].copy_from_slice(&dec.min.to_le_bytes()[..sb]);
    }
    let quants = p.quants_at();
    if p.nibbles {
        // chunk j (32 bytes), lane's 4 bytes: values 4j..4j+4 in the low nibbles, 16+4j.. in the
        // high; the bits above in the planes
        for j in 0..4 {
            for i in 0..4 {
                let (lo, hi) = (dec.q[4 * j + i] as u8, dec.q[16 + 4 * j + i] as u8);
                let k = lane * 4 + i;
                rec[quants + j * 32 + k] = lo & 0x0F | hi << 4;
                for (v, value) in [(2 * j, lo), (2 * j + 1, hi)] {
                    if p.high > 0 {
                        let (plane, shift) = high_bits(p.high, v);
                        rec[p.planes_at() + plane + k] |= (value >> 4) << shift;
                    }
                }
            }
        }
    } else {
        // chunk g (32 bytes), lane's 4 bytes: values 4g..4g+4
        for g in 0..8 {
            for i in 0..4 {
                rec[quants + g * 32 + lane * 4 + i] = dec.q[4 * g + i] as u8;
            }
        }
    }
}

/// A lane's scales (one per sub-block) and offset in a block's record, with its super-block's scales `sup`.
fn lane_scales(p: Packing, rec: &[u8], sup: &[u8], lane: usize) -> ([f32; 2], f32) {
    let value = |at: usize, which: usize| -> f32 {
        if p.half {
            f16_to_f32(u16::from_le_bytes([rec[at], rec[at + 1]]))
        } else {
            let base = &sup[(which * LANES + lane) * 4..];
            f32::from_le_bytes([base[0], base[1], base[2], base[3]]) * rec[at] as i8 as f32
        }
    };
    let sb = p.scale_bytes();
    let scales = std::array::from_fn(|s| if s < p.subs { value((s * LANES + lane) * sb, 0) } else { 0.0 });
    (scales, if p.min { value(p.mins_at() + lane * sb, 1) } else { 0.0 })
}

/// Value `i` (0..32) of `lane` in a record.
fn read_quant(p: Packing, rec: &[u8], lane: usize, i: usize) -> i32 {
    let qs = &rec[p.quants_at()..];
    if p.nibbles {
        let (j, high) = ((i % 16) / 4, i >= 16);
        let k = lane * 4 + i % 4;
        let byte = qs[j * 32 + k];
        let nibble = if high { byte >> 4 } else { byte & 0x0F } as i32;
        if p.high == 0 {
            return nibble;
        }
        let (plane, shift) = high_bits(p.high, 2 * j + high as usize);
        let above = (rec[p.planes_at() + plane + k] >> shift) as i32 & ((1 << p.high) - 1);
        (nibble | above << 4) - if p.high == 2 { 32 } else { 0 }
    } else {
        qs[(i / 4) * 32 + lane * 4 + i % 4] as i8 as i32
    }
}

// ---------------------------------------------------------------- kernels

/// The most activation rows one kernel call takes.
const MAX_ROWS: usize = 8;

/// One kernel call: a group's records, and up to MAX_ROWS activation rows
/// with where their eight outputs go.
struct Tile {
    rec: *const u8,
    record: usize,
    /// the group's super-block scales (K-quants), `super_bytes` per eight blocks
    sup: *const u8,
    super_bytes: usize,
    blocks: usize,
    q: [*const i8; MAX_ROWS],
    /// the rows' q + 128 (VNNI only; null elsewhere)
    u: [*const u8; MAX_ROWS],
    d: [*const f32; MAX_ROWS],
    s: [*const f32; MAX_ROWS],
    out: [*mut f32; MAX_ROWS],
}

#[derive(Clone, Copy)]
struct Kernel {
    /// activation rows per call at most
    rows: usize,
    run: unsafe fn(&Tile, usize),
    /// the tile's group and the next one together (both whole), their sixteen outputs a row adjacent
    pair: Option<unsafe fn(&Tile, usize)>,
}

macro_rules! dispatch_rows {
    ($f:ident, $max:literal, $($c:tt)*) => {{
        unsafe fn run(t: &Tile, n: usize) {
            match n {
                1 => $f::<$($c)*, 1>(t),
                2 => $f::<$($c)*, 2>(t),
                3 => $f::<$($c)*, 3>(t),
                4 => $f::<$($c)*, 4>(t),
                5 if $max > 4 => $f::<$($c)*, 5>(t),
                6 if $max > 4 => $f::<$($c)*, 6>(t),
                7 if $max > 4 => $f::<$($c)*, 7>(t),
                8 if $max > 4 => $f::<$($c)*, 8>(t),
                _ => unreachable!("kernel rows"),
            }
        }
        run as unsafe fn(&Tile, usize)
    }};
}

macro_rules! for_packing {
    ($p:expr, $f:ident, $max:literal) => {
        match ($p.nibbles, $p.high, $p.subs, $p.min, $p.half) {
            (true, 0, 1, true, true) => dispatch_rows!($f, $max, true, 0, 1, true, true),
            (true, 0, 1, true, false) => dispatch_rows!($f, $max, true, 0, 1, true, false),
            (true, 1, 1, true, true) => dispatch_rows!($f, $max, true, 1, 1, true, true),
            (true, 1, 1, true, false) => dispatch_rows!($f, $max, true, 1, 1, true, false),
            (true, 2, 2, false, false) => dispatch_rows!($f, $max, true, 2, 2, false, false),
            (false, 0, 1, false, true) => dispatch_rows!($f, $max, false, 0, 1, false, true),
            other => unreachable!("no kernel for packing {other:?}"),
        }
    };
}

fn kernel_for(p: Packing, isa: Isa) -> Kernel {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Vnni512 => Kernel { rows: 8, run: for_packing!(p, vnni_tile, 8), pair: Some(for_packing!(p, vnni512_pair, 8)) },
        #[cfg(target_arch = "x86_64")]
        Isa::Vnni => Kernel { rows: 8, run: for_packing!(p, vnni_tile, 8), pair: None },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Kernel { rows: 4, run: for_packing!(p, avx2_tile, 4), pair: None },
        _ => Kernel { rows: 4, run: for_packing!(p, scalar_tile, 4), pair: None },
    }
}

/// The kernels' arithmetic, one lane at a time: the reference the SIMD kernels equal bit for bit.
unsafe fn scalar_tile<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    let p = Packing { nibbles: NIB, high: HIGH, subs: SUBS, min: MIN, half: HALF };
    let mut acc = [[0f32; LANES]; R];
    for b in 0..t.blocks {
        let rec = std::slice::from_raw_parts(t.rec.add(b * t.record), t.record);
        let sup = std::slice::from_raw_parts(t.sup.add(b / 8 * t.super_bytes), t.super_bytes);
        for r in 0..R {
            let a = std::slice::from_raw_parts(t.q[r].add(b * BLOCK), BLOCK);
            let (da, sa) = (*t.d[r].add(b), *t.s[r].add(b));
            for lane in 0..LANES {
                let (scales, m) = lane_scales(p, rec, sup, lane);
                for (s, dw) in scales.iter().enumerate().take(SUBS) {
                    let span = BLOCK / SUBS;
                    let isum: i32 = (s * span..(s + 1) * span).map(|i| read_quant(p, rec, lane, i) * a[i] as i32).sum();
                    acc[r][lane] = (dw * da).mul_add(isum as f32, acc[r][lane]);
                }
                if MIN {
                    acc[r][lane] = m.mul_add(sa, acc[r][lane]);
                }
            }
        }
    }
    for r in 0..R {
        std::ptr::copy_nonoverlapping(acc[r].as_ptr(), t.out[r], LANES);
    }
}

/// Eight lanes' scales (or offsets) at `at`: f16s, or 8-bit integers times the super-block's `base`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_scales<const HALF: bool>(at: *const u8, base: *const u8) -> __m256 {
    if HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    } else {
        let ints = _mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i));
        _mm256_mul_ps(_mm256_loadu_ps(base as *const f32), _mm256_cvtepi32_ps(ints))
    }
}

/// A block's scales for its eight lanes (one per sub-block) and their offsets.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_scales<const SUBS: usize, const MIN: bool, const HALF: bool>(t: &Tile, b: usize, p: Packing) -> ([__m256; 2], __m256) {
    let (rec, sup) = (t.rec.add(b * t.record), t.sup.add(b / 8 * t.super_bytes));
    let mut dw = [_mm256_setzero_ps(); 2];
    for (s, d) in dw.iter_mut().enumerate().take(SUBS) {
        *d = load_scales::<HALF>(rec.add(s * LANES * p.scale_bytes()), sup);
    }
    let m = if MIN { load_scales::<HALF>(rec.add(p.mins_at()), sup.add(4 * LANES)) } else { _mm256_setzero_ps() };
    (dw, m)
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn broadcast4(at: *const i8) -> __m256i {
    _mm256_set1_epi32((at as *const i32).read_unaligned())
}

/// The float part of a block, the same in every kernel: for each sub-block,
/// acc += (d_w · d_a) · isum, then acc += m_w · s_a.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scale_block<const SUBS: usize, const MIN: bool>(
    (dw, m): ([__m256; 2], __m256),
    isum: &[__m256i; 2],
    da: f32,
    sa: f32,
    acc: __m256,
) -> __m256 {
    let mut acc = acc;
    let da = _mm256_set1_ps(da);
    for (s, sum) in isum.iter().enumerate().take(SUBS) {
        acc = _mm256_fmadd_ps(_mm256_mul_ps(dw[s], da), _mm256_cvtepi32_ps(*sum), acc);
    }
    if MIN {
        acc = _mm256_fmadd_ps(m, _mm256_set1_ps(sa), acc);
    }
    acc
}

/// Chunk `j` of a block's 4-bit values: its low nibbles (values 4j..4j+4 of
/// each lane's row) and its high ones (values 16+4j..).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn nibbles(qs: *const u8, j: usize) -> (__m256i, __m256i) {
    let low = _mm256_set1_epi8(0x0F);
    let raw = _mm256_loadu_si256(qs.add(32 * j) as *const __m256i);
    (_mm256_and_si256(raw, low), _mm256_and_si256(_mm256_srli_epi16(raw, 4), low))
}

/// Vector v's high bits (`high_bits`), in place above its nibbles.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn above<const HIGH: usize>(planes: *const u8, v: usize) -> __m256i {
    let (plane, shift) = high_bits(HIGH, v);
    let x = _mm256_loadu_si256(planes.add(plane) as *const __m256i);
    // 16-bit shifts: the bits a byte takes from its neighbour fall outside the mask
    let moved = if shift <= 4 {
        _mm256_sll_epi16(x, _mm_cvtsi32_si128(4 - shift as i32))
    } else {
        _mm256_srl_epi16(x, _mm_cvtsi32_si128(shift as i32 - 4))
    };
    _mm256_and_si256(moved, _mm256_set1_epi8((((1 << HIGH) - 1) << 4) as i8))
}

/// Chunk j's two vectors of values (`nibbles`), their high bits added; Q6_K's less 32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values<const HIGH: usize>(rec: *const u8, p: Packing, j: usize) -> [__m256i; 2] {
    let (lo, hi) = nibbles(rec.add(p.quants_at()), j);
    if HIGH == 0 {
        return [lo, hi];
    }
    let planes = rec.add(p.planes_at());
    let (lo, hi) = (_mm256_or_si256(lo, above::<HIGH>(planes, 2 * j)), _mm256_or_si256(hi, above::<HIGH>(planes, 2 * j + 1)));
    if HIGH == 2 {
        let k = _mm256_set1_epi8(32);
        return [_mm256_sub_epi8(lo, k), _mm256_sub_epi8(hi, k)];
    }
    [lo, hi]
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_tile<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    let p = Packing { nibbles: NIB, high: HIGH, subs: SUBS, min: MIN, half: HALF };
    let ones = _mm256_set1_epi16(1);
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..t.blocks {
        let rec = t.rec.add(b * t.record);
        let mut isum = [[zero; 2]; R];
        // 16-bit sums, widened before they can overflow: 16 products of |15 · 127| (4-bit
        // values), 8 of |31 · 127| (5-bit), 8 of |32 · 127| (Q6_K's, per sub-block)
        let mut p16 = [[zero; 2]; R];
        let widen = |p16: &mut [[__m256i; 2]; R], isum: &mut [[__m256i; 2]; R]| {
            for r in 0..R {
                for s in 0..SUBS {
                    isum[r][s] = _mm256_add_epi32(isum[r][s], _mm256_madd_epi16(p16[r][s], ones));
                    p16[r][s] = zero;
                }
            }
        };
        if NIB && HIGH == 2 {
            // signed values: |w| times a with w's sign; sub-block 0 is the low nibbles' values
            for j in 0..4 {
                for (s, w) in values::<HIGH>(rec, p, j).into_iter().enumerate() {
                    let wa = _mm256_abs_epi8(w);
                    for r in 0..R {
                        let a = broadcast4(t.q[r].add(b * BLOCK + 16 * s + 4 * j));
                        p16[r][s] = _mm256_add_epi16(p16[r][s], _mm256_maddubs_epi16(wa, _mm256_sign_epi8(a, w)));
                    }
                }
            }
            widen(&mut p16, &mut isum);
        } else if NIB {
            for j in 0..4 {
                let [lo, hi] = values::<HIGH>(rec, p, j);
                for r in 0..R {
                    let a = t.q[r].add(b * BLOCK);
                    let x = _mm256_maddubs_epi16(lo, broadcast4(a.add(4 * j)));
                    let y = _mm256_maddubs_epi16(hi, broadcast4(a.add(16 + 4 * j)));
                    p16[r][0] = _mm256_add_epi16(p16[r][0], _mm256_add_epi16(x, y));
                }
                if HIGH == 1 && j == 1 {
                    widen(&mut p16, &mut isum);
                }
            }
            widen(&mut p16, &mut isum);
        } else {
            let qs = rec.add(p.quants_at());
            for g in 0..8 {
                let w = _mm256_loadu_si256(qs.add(32 * g) as *const __m256i);
                let wa = _mm256_abs_epi8(w);
                for r in 0..R {
                    let a = broadcast4(t.q[r].add(b * BLOCK + 4 * g));
                    let prod = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(a, w));
                    isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(prod, ones));
                }
            }
        }
        let scales = block_scales::<SUBS, MIN, HALF>(t, b, p);
        for r in 0..R {
            acc[r] = scale_block::<SUBS, MIN>(scales, &isum[r], *t.d[r].add(b), *t.s[r].add(b), acc[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(t.out[r], acc[r]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn vnni_tile<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    let p = Packing { nibbles: NIB, high: HIGH, subs: SUBS, min: MIN, half: HALF };
    let ones8 = _mm256_set1_epi8(1);
    let zero = _mm256_setzero_si256();
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..t.blocks {
        let rec = t.rec.add(b * t.record);
        let mut isum = [[zero; 2]; R];
        // signed values: (a + 128) · w summed, less 128 · Σw (the activations as the unsigned operand)
        let mut wsum = [zero; 2];
        let signed = |w: __m256i, s: usize, at: usize, wsum: &mut [__m256i; 2], isum: &mut [[__m256i; 2]; R]| {
            wsum[s] = _mm256_dpbusd_epi32(wsum[s], ones8, w);
            for r in 0..R {
                let a = broadcast4(t.u[r].add(b * BLOCK + at) as *const i8);
                isum[r][s] = _mm256_dpbusd_epi32(isum[r][s], a, w);
            }
        };
        if NIB && HIGH == 2 {
            // sub-block 0 is the low nibbles' values
            for j in 0..4 {
                for (s, w) in values::<HIGH>(rec, p, j).into_iter().enumerate() {
                    signed(w, s, 16 * s + 4 * j, &mut wsum, &mut isum);
                }
            }
        } else if NIB {
            for j in 0..4 {
                let [lo, hi] = values::<HIGH>(rec, p, j);
                for r in 0..R {
                    let a = t.q[r].add(b * BLOCK);
                    isum[r][0] = _mm256_dpbusd_epi32(isum[r][0], lo, broadcast4(a.add(4 * j)));
                    isum[r][0] = _mm256_dpbusd_epi32(isum[r][0], hi, broadcast4(a.add(16 + 4 * j)));
                }
            }
        } else {
            let qs = rec.add(p.quants_at());
            for g in 0..8 {
                signed(_mm256_loadu_si256(qs.add(32 * g) as *const __m256i), 0, 4 * g, &mut wsum, &mut isum);
            }
        }
        if !NIB || HIGH == 2 {
            for r in 0..R {
                for s in 0..SUBS {
                    isum[r][s] = _mm256_sub_epi32(isum[r][s], _mm256_slli_epi32(wsum[s], 7));
                }
            }
        }
        let scales = block_scales::<SUBS, MIN, HALF>(t, b, p);
        for r in 0..R {
            acc[r] = scale_block::<SUBS, MIN>(scales, &isum[r], *t.d[r].add(b), *t.s[r].add(b), acc[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(t.out[r], acc[r]);
    }
}

/// A 32-byte vector at `at` of one group, and at `at + next` of the next group, as one.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn both(at: *const u8, next: usize) -> __m512i {
    let first = _mm512_castsi256_si512(_mm256_loadu_si256(at as *const __m256i));
    _mm512_inserti64x4::<1>(first, _mm256_loadu_si256(at.add(next) as *const __m256i))
}

/// `values` of two groups' blocks, each group's in its own half.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values512<const HIGH: usize>(rec: *const u8, next: usize, p: Packing, j: usize) -> [__m512i; 2] {
    let low = _mm512_set1_epi8(0x0F);
    let raw = both(rec.add(p.quants_at() + 32 * j), next);
    let (lo, hi) = (_mm512_and_si512(raw, low), _mm512_and_si512(_mm512_srli_epi32::<4>(raw), low));
    if HIGH == 0 {
        return [lo, hi];
    }
    let above = |v: usize| {
        let (plane, shift) = high_bits(HIGH, v);
        let x = both(rec.add(p.planes_at() + plane), next);
        // as `above`: the bits a byte takes from its neighbour fall outside the mask
        let moved = if shift <= 4 {
            _mm512_sll_epi32(x, _mm_cvtsi32_si128(4 - shift as i32))
        } else {
            _mm512_srl_epi32(x, _mm_cvtsi32_si128(shift as i32 - 4))
        };
        _mm512_and_si512(moved, _mm512_set1_epi8((((1 << HIGH) - 1) << 4) as i8))
    };
    let (lo, hi) = (_mm512_or_si512(lo, above(2 * j)), _mm512_or_si512(hi, above(2 * j + 1)));
    if HIGH == 2 {
        let k = _mm512_set1_epi8(32);
        return [_mm512_sub_epi8(lo, k), _mm512_sub_epi8(hi, k)];
    }
    [lo, hi]
}

/// `block_scales` of two groups' blocks, each group's in its own half.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_scales512<const SUBS: usize, const MIN: bool, const HALF: bool>(t: &Tile, b: usize, p: Packing) -> ([__m512; 2], __m512) {
    let (rec, sup) = (t.rec.add(b * t.record), t.sup.add(b / 8 * t.super_bytes));
    let (next, next_sup) = (t.blocks * t.record, t.blocks.div_ceil(8) * t.super_bytes);
    let load = |at: *const u8, base: *const u8| -> __m512 {
        let pair = |x: *const u8| _mm_unpacklo_epi64(_mm_loadl_epi64(x as *const __m128i), _mm_loadl_epi64(x.add(next) as *const __m128i));
        if HALF {
            let halves = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(at as *const __m128i)),
                                                       _mm_loadu_si128(at.add(next) as *const __m128i));
            _mm512_cvtph_ps(halves)
        } else {
            let ints = _mm512_cvtepi8_epi32(pair(at));
            let bases = _mm512_castsi512_ps(_mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_loadu_si256(base as *const __m256i)),
                _mm256_loadu_si256(base.add(next_sup) as *const __m256i),
            ));
            _mm512_mul_ps(bases, _mm512_cvtepi32_ps(ints))
        }
    };
    let mut dw = [_mm512_setzero_ps(); 2];
    for (s, d) in dw.iter_mut().enumerate().take(SUBS) {
        *d = load(rec.add(s * LANES * p.scale_bytes()), sup);
    }
    let m = if MIN { load(rec.add(p.mins_at()), sup.add(4 * LANES)) } else { _mm512_setzero_ps() };
    (dw, m)
}

/// `vnni_tile` for the tile's group and the next, on 512-bit vectors: each
/// output lane is computed by the same operations in the same order as in
/// `vnni_tile` (the same bits), sixteen rows at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn vnni512_pair<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    let p = Packing { nibbles: NIB, high: HIGH, subs: SUBS, min: MIN, half: HALF };
    let next = t.blocks * t.record;
    let ones8 = _mm512_set1_epi8(1);
    let zero = _mm512_setzero_si512();
    let broadcast = |at: *const u8| _mm512_set1_epi32((at as *const i32).read_unaligned());
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..t.blocks {
        let rec = t.rec.add(b * t.record);
        let mut isum = [[zero; 2]; R];
        let mut wsum = [zero; 2];
        let signed = |w: __m512i, s: usize, at: usize, wsum: &mut [__m512i; 2], isum: &mut [[__m512i; 2]; R]| {
            wsum[s] = _mm512_dpbusd_epi32(wsum[s], ones8, w);
            for r in 0..R {
                isum[r][s] = _mm512_dpbusd_epi32(isum[r][s], broadcast(t.u[r].add(b * BLOCK + at)), w);
            }
        };
        if NIB && HIGH == 2 {
            for j in 0..4 {
                for (s, w) in values512::<HIGH>(rec, next, p, j).into_iter().enumerate() {
                    signed(w, s, 16 * s + 4 * j, &mut wsum, &mut isum);
                }
            }
        } else if NIB {
            for j in 0..4 {
                let [lo, hi] = values512::<HIGH>(rec, next, p, j);
                for r in 0..R {
                    let a = t.q[r].add(b * BLOCK) as *const u8;
                    isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], lo, broadcast(a.add(4 * j)));
                    isum[r][0] = _mm512_dpbusd_epi32(isum[r][0], hi, broadcast(a.add(16 + 4 * j)));
                }
            }
        } else {
            let qs = rec.add(p.quants_at());
            for g in 0..8 {
                signed(both(qs.add(32 * g), next), 0, 4 * g, &mut wsum, &mut isum);
            }
        }
        if !NIB || HIGH == 2 {
            for r in 0..R {
                for s in 0..SUBS {
                    isum[r][s] = _mm512_sub_epi32(isum[r][s], _mm512_slli_epi32::<7>(wsum[s]));
                }
            }
        }
        let (dw, m) = block_scales512::<SUBS, MIN, HALF>(t, b, p);
        for r in 0..R {
            let da = _mm512_set1_ps(*t.d[r].add(b));
            for s in 0..SUBS {
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw[s], da), _mm512_cvtepi32_ps(isum[r][s]), acc[r]);
            }
            if MIN {
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(*t.s[r].add(b)), acc[r]);
            }
        }
    }
    for r in 0..R {
        _mm512_storeu_ps(t.out[r], acc[r]);
    }
}

// ---------------------------------------------------------------- halves

/// IEEE half → f32 (every value exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let (exp, mant) = (((h >> 10) & 0x1f) as u32, (h & 0x3ff) as u32);
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, _) => {
            let shift = mant.leading_zeros() - 21; // subnormal: normalise the mantissa
            sign | ((113 - shift) << 23) | ((mant << shift) & 0x3ff) << 13
        }
        (31, _) => sign | 0x7f80_0000 | (mant << 13),
        _ => sign | ((exp + 112) << 23) | (mant << 13),
    };
    f32::from_bits(bits)
}

/// The half that is exactly `x`, if there is one.
fn f32_to_f16_exact(x: f32) -> Option<u16> {
    if x == 0.0 {
        return Some(if x.is_sign_negative() { 0x8000 } else { 0 });
    }
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exp = ((bits >> 23) & 0xff) as i32 - 127;
    if !(-24..=15).contains(&exp) {
        return None;
    }
    let h = if exp >= -14 {
        sign | (((exp + 15) as u16) << 10) | ((bits >> 13) & 0x3ff) as u16
    } else {
        let mant = (bits & 0x7f_ffff) | 0x80_0000; // subnormal half: value = mant · 2^-24
        sign | (mant >> (13 + (-14 - exp))) as u16
    };
    (f16_to_f32(h) == x).then_some(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::cpu::quant::{self, QuantMatrix, FORMATS};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                // a spread of magnitudes, so blocks get different scales
                let u = ((x >> 33) as f64 / (1u64 << 31) as f64) as f32 - 0.5;
                u * if (x >> 20) % 7 == 0 { 4.0 } else { 0.3 }
            })
            .collect()
    }

    fn isas() -> Vec<Isa> {
        let mut out = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                out.push(Isa::Avx2);
            }
            if crate::cpu::simd::has_vnni() {
                out.push(Isa::Vnni);
            }
            if crate::cpu::simd::has_vnni512() {
                out.push(Isa::Vnni512);
            }
        }
        out
    }

    /// Every format with a packing: the packed values are ggml's dequantized
    /// values bit for bit, every ISA's kernel gives the scalar reference's
    /// bits, a row gives the same bits alone as in any batch (rows at every
    /// tile position, a partial last group), and the products are the dense
    /// ones up to the activations' 8-bit rounding (and closer when precise).
    #[test]
    fn packed_formats_are_ggmls_values_and_every_kernel_agrees() {
        if !quant::available() {
            return;
        }
        let (rows, cols) = (21, 512);
        for &(ty, name, _) in FORMATS.iter().filter(|f| PackedMatrix::packs(f.0)) {
            let dense = values(rows * cols, ty as u64);
            let bytes = quant::quantize_rows(ty, rows, cols, &dense).unwrap();
            let ggml = QuantMatrix::quantize_unpacked(ty, rows, cols, bytes.clone());
            let m = QuantMatrix::new(ty, rows, cols, bytes).unwrap();
            let packed = m.packed().expect(name);
            let (mut want, mut got) = (vec![0f32; rows * cols], vec![0f32; rows * cols]);
            ggml.dequantize(&mut want);
            m.dequantize(&mut got);
            // the same numbers (a zero may differ in sign: 8·d - 8·d is +0 where ggml has 0·d)
            if let Some(i) = (0..want.len()).find(|&i| want[i] != got[i]) { panic!("{name}: value {i} (row {}, col {}) is {} packed, {} in ggml", i / cols, i % cols, got[i], want[i]); }
            for precise in [false, true] {
                let batch = 11;
                let x = values(batch * cols, 99 + ty as u64);
                let mut act = Activations::new();
                act.quantize(&x, cols, precise);
                let mut reference = vec![0f32; batch * rows];
                packed.matmul_with(kernel_for(packed.packing, Isa::Scalar), &act, &mut reference);
                for isa in isas() {
                    let kernel = kernel_for(packed.packing, isa);
                    let mut out = vec![0f32; batch * rows];
                    packed.matmul_with(kernel, &act, &mut out);
                    assert!(out.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} {isa:?} precise={precise}");
                    for b in [0, 3, 10] {
                        let mut one = Activations::new();
                        one.quantize(&x[b * cols..][..cols], cols, precise);
                        let mut alone = vec![0f32; rows];
                        packed.matmul_with(kernel, &one, &mut alone);
                        assert_eq!(alone, out[b * rows..][..rows], "{name} {isa:?}: row {b} alone");
                    }
                }
                // with `precise`, both passes for every output, as the second pass had it before it was
                // confined to the outputs that could be a row's largest
                let mut both = vec![0f32; 2 * batch * rows];
                if precise {
                    packed.product(kernel_for(packed.packing, Isa::Scalar), &act, 1, &mut both);
                }
                for b in 0..batch {
                    let full: Vec<f32> = (0..rows).map(|r| both[2 * b * rows + r] + both[(2 * b + 1) * rows + r]).collect();
                    let top = (0..rows).max_by(|&i, &j| full[i].total_cmp(&full[j])).unwrap();
                    for r in 0..rows {
                        let w = &want[r * cols..][..cols];
                        let xs = &x[b * cols..][..cols];
                        let exact: f64 = w.iter().zip(xs).map(|(a, c)| *a as f64 * *c as f64).sum();
                        let scale: f64 = w.iter().zip(xs).map(|(a, c)| (*a as f64 * *c as f64).abs()).sum();
                        let got = reference[b * rows + r];
                        let err = (got as f64 - exact).abs() / scale;
                        let top_row = precise && r == top;
                        assert!(err < if top_row { 1e-4 } else { 1e-2 }, "{name} precise={precise}: relative error {err}");
                        if precise {
                            // refined (both passes' bits) or left at the first pass's, below the top
                            let first = both[2 * b * rows + r];
                            assert!(got.to_bits() == full[r].to_bits() || (got.to_bits() == first.to_bits() && full[r] < full[top]),
                                    "{name}: row {b} output {r}");
                            assert!(!top_row || got.to_bits() == full[r].to_bits(), "{name}: row {b}'s top refined");
                            assert!(got <= full[top], "{name}: row {b}'s output {r} above its top");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn halves_convert_exactly_both_ways() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if x.is_finite() {
                assert_eq!(f32_to_f16_exact(x).map(f16_to_f32), Some(x), "{h:#x}");
            }
        }
        assert_eq!(f32_to_f16_exact(1.0 + 1e-6), None);
        assert_eq!(f32_to_f16_exact(1e6), None);
    }
}
