//! Activation rows quantized to 8 bits per 32 columns for the packed kernels
//! (`packed.rs`), as llama.cpp's Q8_0/Q8_1: a scale per block, the values
//! rounded to nearest (ties to even), and the scaled sum of each block's
//! values for the formats with offsets.

use crate::threads::pool::{self, SendPtr};
use crate::cpu::simd::{isa, Isa};

/// Columns per block (activations and packed weights).
pub const BLOCK: usize = 32;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Activation rows quantized per 32 columns to 8 bits: `q` [rows, cols],
/// and per block its scale `d` and `s` = d·Σq. With `precise`, each input row
/// is two rows here: its 8-bit values, then what they missed, quantized the
/// same way (about 16-bit activations, for the output head).
pub struct Activations {
    pub rows: usize,
    pub cols: usize,
    pub precise: bool,
    pub(crate) q: Vec<i8>,
    /// q + 128 as unsigned bytes, for VNNI's unsigned × signed products with 8-bit weights
    pub(crate) u: Vec<u8>,
    pub(crate) d: Vec<f32>,
    pub(crate) s: Vec<f32>,
}

impl Activations {
    pub fn new() -> Self {
        Activations { rows: 0, cols: 0, precise: false, q: Vec::new(), u: Vec::new(), d: Vec::new(), s: Vec::new() }
    }

    /// The input rows (half of `rows` when precise).
    pub fn batch(&self) -> usize {
        if self.precise {
            self.rows / 2
        } else {
            self.rows
        }
    }

    /// Quantize `x` [batch, cols] (cols a multiple of 32), reusing this buffer.
    pub fn quantize(&mut self, x: &[f32], cols: usize, precise: bool) {
        assert!(cols % BLOCK == 0 && x.len() % cols == 0, "activations: {cols} columns");
        let batch = x.len() / cols;
        let rows = if precise { 2 * batch } else { batch };
        let blocks = cols / BLOCK;
        self.rows = rows;
        self.cols = cols;
        self.precise = precise;
        self.q.resize(rows * cols, 0);
        let unsigned = isa().unsigned_activations();
        self.u.resize(if unsigned { rows * cols } else { 0 }, 0);
        self.d.resize(rows * blocks, 0.0);
        self.s.resize(rows * blocks, 0.0);
        let (q, d, s) = (SendPtr(self.q.as_mut_ptr()), SendPtr(self.d.as_mut_ptr()), SendPtr(self.s.as_mut_ptr()));
        let u = SendPtr(self.u.as_mut_ptr());
        let per = if batch >= 8 { 2 } else { batch.max(1) };
        let work = |chunk: usize| {
            let (q, d, s, u) = (q, d, s, u);
            // q + 128 beside q, for VNNI (one pass over the row's bytes, which are in cache)
            let flip = |r: usize| {
                if unsigned {
                    // SAFETY: row r is this chunk's alone; q and u are different buffers (so this vectorizes)
                    let (from, to) = unsafe {
                        (std::slice::from_raw_parts(q.get().add(r * cols) as *const u8, cols), std::slice::from_raw_parts_mut(u.get().add(r * cols), cols))
                    };
                    to.iter_mut().zip(from).for_each(|(t, f)| *t = f ^ 0x80);
                }
            };
            for b in chunk * per..((chunk + 1) * per).min(batch) {
                let src = &x[b * cols..][..cols];
                let mut rest = [0f32; BLOCK];
                for k in 0..blocks {
                    let xs = &src[k * BLOCK..][..BLOCK];
                    let r = if precise { 2 * b } else { b };
                    // SAFETY: row r (and r + 1) are this chunk's alone
                    let (qr, dr, sr) = unsafe {
                        (
                            std::slice::from_raw_parts_mut((q.get() as *mut i8).add(r * cols + k * BLOCK), BLOCK),
                            &mut *(d.get() as *mut f32).add(r * blocks + k),
                            &mut *(s.get() as *mut f32).add(r * blocks + k),
                        )
                    };
                    quantize_block(xs, qr, dr, sr);
                    if precise {
                        for i in 0..BLOCK {
                            rest[i] = xs[i] - qr[i] as f32 * *dr;
                        }
                        let (qr, dr, sr) = unsafe {
                            (
                                std::slice::from_raw_parts_mut((q.get() as *mut i8).add((r + 1) * cols + k * BLOCK), BLOCK),
                                &mut *(d.get() as *mut f32).add((r + 1) * blocks + k),
                                &mut *(s.get() as *mut f32).add((r + 1) * blocks + k),
                            )
                        };
                        quantize_block(&rest, qr, dr, sr);
                    }
                }
                let r = if precise { 2 * b } else { b };
                flip(r);
                if precise {
                    flip(r + 1);
                }
            }
        };
        let chunks = batch.div_ceil(per);
        if chunks > 1 {
            pool::run(chunks, &work);
        } else if chunks == 1 {
            work(0);
        }
    }
}

impl Default for Activations {
    fn default() -> Self {
        Self::new()
    }
}

/// 32 values to 8 bits: d = max|x| / 127, q = x / d rounded to nearest (ties to even).
#[inline]
fn quantize_block(x: &[f32], q: &mut [i8], d: &mut f32, s: &mut f32) {
    #[cfg(target_arch = "x86_64")]
    if isa() != Isa::Scalar {
        // SAFETY: isa() found AVX2
        unsafe { quantize_block_avx2(x, q, d, s) };
        return;
    }
    quantize_block_scalar(x, q, d, s)
}

/// quantize_block's arithmetic with AVX2 (the same bits: max and the integer sum are exact,
/// and the conversion rounds to nearest even as round_ties_even does).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8], d: &mut f32, s: &mut f32) {
    let p = x.as_ptr();
    let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
    let sign = _mm256_set1_ps(-0.0);
    let a = v.map(|x| _mm256_andnot_ps(sign, x));
    let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    let scale = amax / 127.0;
    let inv = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
    let i = v.map(|x| _mm256_cvtps_epi32(_mm256_mul_ps(x, inv)));
    let total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    let t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    let t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0b01_00_11_10));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0b00_00_00_01)));
    // i32 → i8 (the values are within ±127): packs interleave 128-bit lanes, a permute restores the order
    let w = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
    *d = scale;
    *s = scale * sum as f32;
}

fn quantize_block_scalar(x: &[f32], q: &mut [i8], d: &mut f32, s: &mut f32) {
    let amax = x.iter().fold(0f32, |m, v| {
        let a = v.abs();
        if a > m {
            a
        } else {
            m
        }
    });
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (o, v) in q.iter_mut().zip(x) {
        let r = (v * inv).round_ties_even() as i32;
        *o = r as i8;
        sum += r;
    }
    *d = scale;
    *s = scale * sum as f32;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SIMD activation quantizer gives the scalar one's bits, ties and zeros included.
    #[test]
    fn activation_quantizers_agree() {
        let mut xs = (0..32 * 64).map(|i| ((i as u32).wrapping_mul(2654435761) >> 8) as f32 / 16777216.0 - 0.5).collect::<Vec<f32>>();
        xs[..32].fill(0.0);
        for (i, v) in xs[32..64].iter_mut().enumerate() {
            *v = (i as f32 - 16.0) * 0.5 * 127.0 / 8.0; // exact halves: ties to even
        }
        for x in xs.chunks_exact(32) {
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            let (mut da, mut db, mut sa, mut sb) = (0f32, 0f32, 0f32, 0f32);
            quantize_block_scalar(x, &mut a, &mut da, &mut sa);
            quantize_block(x, &mut b, &mut db, &mut sb);
            assert_eq!((a, da.to_bits(), sa.to_bits()), (b, db.to_bits(), sb.to_bits()));
        }
    }
}
