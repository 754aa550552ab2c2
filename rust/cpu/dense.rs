//! Float32 weights for the CPU step (a GGUF's F32/F16/BF16 tensors, experts
//! dequantized at load, safetensors models), repacked as `packed.rs` does:
//! eight weight rows interleaved per column, so one 256-bit load holds a
//! column of eight rows and serves every activation row of the call.
//!
//! An output is two running sums, over the even and the odd columns, fused
//! multiply-adds in column order, then their sum: the same operations
//! whatever the batch, so a row's result never depends on the other rows.

use crate::threads::pool::{self, SendPtr};
use crate::cpu::simd::avx2;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

const LANES: usize = 8;
const MAX_ROWS: usize = 4;

/// A float32 weight matrix [rows, cols], eight rows interleaved per column.
pub struct DenseMatrix {
    pub rows: usize,
    pub cols: usize,
    data: Vec<f32>,
}

impl DenseMatrix {
    /// `w` [rows, cols] row-major.
    pub fn new(rows: usize, cols: usize, w: &[f32]) -> Result<Self, String> {
        if w.len() != rows * cols {
            return Err(format!("{} values given for a [{rows}, {cols}] matrix", w.len()));
        }
        let groups = rows.div_ceil(LANES);
        let mut data = vec![0f32; groups * cols * LANES];
        for (r, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
            let (g, lane) = (r / LANES, r % LANES);
            for (c, &v) in row.iter().enumerate() {
                data[(g * cols + c) * LANES + lane] = v;
            }
        }
        Ok(DenseMatrix { rows, cols, data })
    }

    pub fn nbytes(&self) -> usize {
        self.data.len() * 4
    }

    /// out [batch, rows] = x [batch, cols] · Wᵀ
    pub fn matmul(&self, x: &[f32], out: &mut [f32]) {
        let batch = x.len() / self.cols.max(1);
        assert!(x.len() == batch * self.cols && out.len() == batch * self.rows, "dense matmul shapes");
        let groups = self.rows.div_ceil(LANES);
        let row_chunk = if batch <= 64 { batch.max(1) } else { 32 };
        let row_chunks = batch.div_ceil(row_chunk);
        let group_chunk = groups.div_ceil((4 * pool::threads()).div_ceil(row_chunks).max(1)).max(1);
        let group_chunks = groups.div_ceil(group_chunk);
        let fast = avx2();
        let out_ptr = SendPtr(out.as_mut_ptr());
        pool::run(group_chunks * row_chunks, &|task| {
            let (gc, rc) = (task % group_chunks, task / group_chunks);
            let out = out_ptr.get();
            for g in gc * group_chunk..((gc + 1) * group_chunk).min(groups) {
                let w = &self.data[g * self.cols * LANES..][..self.cols * LANES];
                let valid = LANES.min(self.rows - g * LANES);
                let mut r0 = rc * row_chunk;
                let end = ((rc + 1) * row_chunk).min(batch);
                while r0 < end {
                    let n = MAX_ROWS.min(end - r0);
                    let mut sums = [[0f32; LANES]; MAX_ROWS];
                    let xs: [&[f32]; MAX_ROWS] = std::array::from_fn(|i| &x[(r0 + i.min(n - 1)) * self.cols..][..self.cols]);
                    #[cfg(target_arch = "x86_64")]
                    if fast {
                        // SAFETY: avx2() checked the CPU
                        unsafe { tile_avx2(w, &xs, n, &mut sums) };
                    } else {
                        tile(w, &xs, n, &mut sums);
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    tile(w, &xs, n, &mut sums);
                    for (i, lanes) in sums.iter().enumerate().take(n) {
                        for (l, &v) in lanes.iter().enumerate().take(valid) {
                            // SAFETY: (row r0 + i, group g) outputs are this task's alone
                            unsafe { *out.add((r0 + i) * self.rows + g * LANES + l) = v };
                        }
                    }
                    r0 += n;
                }
            }
        });
    }
}

/// The reference: per lane, even and odd columns' fused sums, then their sum.
fn tile(w: &[f32], xs: &[&[f32]; MAX_ROWS], n: usize, sums: &mut [[f32; LANES]; MAX_ROWS]) {
    let cols = xs[0].len();
    for r in 0..n {
        for lane in 0..LANES {
            let (mut even, mut odd) = (0f32, 0f32);
            for c in 0..cols {
                let v = w[c * LANES + lane];
                if c % 2 == 0 {
                    even = xs[r][c].mul_add(v, even);
                } else {
                    odd = xs[r][c].mul_add(v, odd);
                }
            }
            sums[r][lane] = even + odd;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(w: &[f32], xs: &[&[f32]; MAX_ROWS], n: usize, sums: &mut [[f32; LANES]; MAX_ROWS]) {
    let cols = xs[0].len();
    let mut even = [_mm256_setzero_ps(); MAX_ROWS];
    let mut odd = [_mm256_setzero_ps(); MAX_ROWS];
    let wp = w.as_ptr();
    let mut c = 0;
    while c + 1 < cols {
        let w0 = _mm256_loadu_ps(wp.add(c * LANES));
        let w1 = _mm256_loadu_ps(wp.add((c + 1) * LANES));
        for r in 0..MAX_ROWS {
            even[r] = _mm256_fmadd_ps(_mm256_set1_ps(*xs[r].get_unchecked(c)), w0, even[r]);
            odd[r] = _mm256_fmadd_ps(_mm256_set1_ps(*xs[r].get_unchecked(c + 1)), w1, odd[r]);
        }
        c += 2;
    }
    if c < cols {
        let w0 = _mm256_loadu_ps(wp.add(c * LANES));
        for r in 0..MAX_ROWS {
            even[r] = _mm256_fmadd_ps(_mm256_set1_ps(*xs[r].get_unchecked(c)), w0, even[r]);
        }
    }
    for r in 0..n {
        _mm256_storeu_ps(sums[r].as_mut_ptr(), _mm256_add_ps(even[r], odd[r]));
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2000) as f32 / 1000.0 - 1.0).collect()
    }

    /// The SIMD kernel gives the reference's bits; a row alone gives what it gives in a batch;
    /// the products are the f64 ones up to f32 rounding.
    #[test]
    fn rows_are_their_own_and_the_kernels_agree() {
        let (rows, cols, batch) = (19, 37, 9);
        let w = values(rows * cols, 1);
        let x = values(batch * cols, 2);
        let m = DenseMatrix::new(rows, cols, &w).unwrap();
        let mut out = vec![0f32; batch * rows];
        m.matmul(&x, &mut out);
        for b in 0..batch {
            let mut alone = vec![0f32; rows];
            m.matmul(&x[b * cols..][..cols], &mut alone);
            assert_eq!(alone, out[b * rows..][..rows]);
            for r in 0..rows {
                let exact: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[b * cols + c] as f64).sum();
                assert!((out[b * rows + r] as f64 - exact).abs() < 1e-4, "{} vs {exact}", out[b * rows + r]);
            }
        }
        let xs: [&[f32]; MAX_ROWS] = std::array::from_fn(|i| &x[i * cols..][..cols]);
        let (mut a, mut b) = ([[0f32; LANES]; MAX_ROWS], [[0f32; LANES]; MAX_ROWS]);
        tile(&m.data[..cols * LANES], &xs, MAX_ROWS, &mut a);
        if avx2() {
            #[cfg(target_arch = "x86_64")]
            unsafe {
                tile_avx2(&m.data[..cols * LANES], &xs, MAX_ROWS, &mut b)
            };
            assert_eq!(a, b);
        }
    }
}
