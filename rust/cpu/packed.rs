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
use crate::cpu::packed_kernels::{kernel_for, Kernel, Tile, MAX_ROWS};
pub use crate::cpu::packed_layout::{f16_to_f32, LANES};
use crate::cpu::packed_layout::{f32_to_f16_exact, high_bits, lane_scales, read_quant, Packing};
use crate::threads::pool::{self, SendPtr};

use std::sync::Arc;

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
