//! The CPU step's per-row operations between its matmuls: RMSNorm, rotary
//! rotation, the gated activations (AVX2 where the CPU has it), and the
//! split of a step's rows over the pool's threads. Each row is computed by
//! the same operations whatever rows share the step.

use crate::threads::pool::{self, SendPtr};
use crate::cpu::simd::avx2;

/// The gated MLP's f(gate, up).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// gpt-oss: gate clamped above, up on both sides, then (up + 1)·gate·σ(α·gate)
    SwigluOai { alpha: f32, limit: f32 },
}

/// Rows at which per-row work is split over the threads.
pub const PARALLEL_ROWS: usize = 16;

/// `f(a_rows, b_rows)` over matching chunks of rows of `a` [t, wa] and `b` [t, wb], on the pool where t is large.
pub fn per_rows2(a: &mut [f32], b: &mut [f32], wa: usize, wb: usize, f: impl Fn(&mut [f32], &mut [f32]) + Sync) {
    let t = a.len() / wa;
    let b = &mut b[..t * wb];
    if t < PARALLEL_ROWS {
        f(a, b);
        return;
    }
    let per = t.div_ceil(2 * pool::threads()).max(4);
    let (pa, pb) = (SendPtr(a.as_mut_ptr()), SendPtr(b.as_mut_ptr()));
    pool::run(t.div_ceil(per), &|c| {
        let (s, e) = (c * per, ((c + 1) * per).min(t));
        // SAFETY: chunks of rows are disjoint
        unsafe { f(std::slice::from_raw_parts_mut(pa.get().add(s * wa), (e - s) * wa), std::slice::from_raw_parts_mut(pb.get().add(s * wb), (e - s) * wb)) };
    });
}

/// How a norm scales a row (architectures.py's `norm_kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// x / √(mean(x²) + eps) · w
    Rms,
    /// (x - mean) / √(var + eps) · w: a LayerNorm without bias (Cohere)
    Layer,
}

/// `out` = the norm of `x` · w.
pub fn norm(kind: NormKind, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    match kind {
        NormKind::Rms => rms_norm(x, w, eps, out),
        NormKind::Layer => layer_norm(x, w, eps, out),
    }
}

/// `out` = the norm of every row of `x` (rows of the weight's width).
pub fn norm_rows(kind: NormKind, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    let t = x.len() / n;
    if t < PARALLEL_ROWS {
        for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            norm(kind, xr, w, eps, or);
        }
        return;
    }
    let per = t.div_ceil(2 * pool::threads()).max(4);
    let po = SendPtr(out.as_mut_ptr());
    pool::run(t.div_ceil(per), &|c| {
        let (s, e) = (c * per, ((c + 1) * per).min(t));
        // SAFETY: chunks of rows are disjoint
        let out = unsafe { std::slice::from_raw_parts_mut(po.get().add(s * n), (e - s) * n) };
        for (xr, or) in x[s * n..e * n].chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            norm(kind, xr, w, eps, or);
        }
    });
}

/// out = x / √(mean(x²) + eps) · w
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let scale = inv_rms(x, eps);
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// out = (x - mean) / √(mean((x - mean)²) + eps) · w
pub fn layer_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let scale = 1.0 / (var + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = (v - mean) * scale * g;
    }
}

pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = inv_rms(x, eps);
    for (v, g) in x.iter_mut().zip(w) {
        *v = *v * scale * g;
    }
}

/// 1 / √(mean(x²) + eps), the sum of squares in eight partial sums (so it vectorizes).
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0f32; 8];
    let body = x.len() / 8 * 8;
    for c in x[..body].chunks_exact(8) {
        for i in 0..8 {
            acc[i] += c[i] * c[i];
        }
    }
    for (i, v) in x[body..].iter().enumerate() {
        acc[i] += v * v;
    }
    let sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    1.0 / (sum / x.len() as f32 + eps).sqrt()
}

/// Rotate halves of the head's leading `cs.len()` values: [x1, x2] → [x1·cos − x2·sin, x2·cos + x1·sin].
pub fn rotate(h: &mut [f32], cs: &[f32]) {
    let half = cs.len() / 2;
    let (cos, sin) = cs.split_at(half);
    let (x1, rest) = h.split_at_mut(half);
    let x2 = &mut rest[..half];
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        x1[i] = a * cos[i] - b * sin[i];
        x2[i] = b * cos[i] + a * sin[i];
    }
}

/// m = f(g, u) elementwise: eight lanes at a time with AVX2 (the tail by the same lane operations).
pub fn activate_row(act: Activation, g: &[f32], u: &[f32], m: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: avx2() checked the CPU
        unsafe { activate_avx2(act, g, u, m) };
        return;
    }
    for i in 0..m.len() {
        m[i] = activate(act, g[i], u[i]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn activate_avx2(act: Activation, g: &[f32], u: &[f32], m: &mut [f32]) {
    use crate::cpu::simd::{sigmoid8, tanh8};
    use std::arch::x86_64::*;
    let f = |g: __m256, u: __m256| -> __m256 {
        match act {
            Activation::Silu => _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), u),
            Activation::GeluTanh => {
                let z = _mm256_mul_ps(_mm256_set1_ps(0.797_884_6), _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715), _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
                let half = _mm256_mul_ps(_mm256_set1_ps(0.5), g);
                _mm256_mul_ps(_mm256_mul_ps(half, _mm256_add_ps(_mm256_set1_ps(1.0), tanh8(z))), u)
            }
            Activation::SwigluOai { alpha, limit } => {
                let g = _mm256_min_ps(g, _mm256_set1_ps(limit));
                let u = _mm256_max_ps(_mm256_min_ps(u, _mm256_set1_ps(limit)), _mm256_set1_ps(-limit));
                let glu = _mm256_mul_ps(g, sigmoid8(_mm256_mul_ps(g, _mm256_set1_ps(alpha))));
                _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0)), glu)
            }
        }
    };
    let n = m.len();
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(m.as_mut_ptr().add(i), f(_mm256_loadu_ps(g.as_ptr().add(i)), _mm256_loadu_ps(u.as_ptr().add(i))));
        i += 8;
    }
    for j in i..n {
        m[j] = _mm256_cvtss_f32(f(_mm256_set1_ps(g[j]), _mm256_set1_ps(u[j])));
    }
}


fn activate(act: Activation, g: f32, u: f32) -> f32 {
    match act {
        Activation::Silu => g / (1.0 + (-g).exp()) * u,
        Activation::GeluTanh => {
            const K: f32 = 0.797_884_6; // √(2/π)
            0.5 * g * (1.0 + (K * (g + 0.044715 * g * g * g)).tanh()) * u
        }
        Activation::SwigluOai { alpha, limit } => {
            let (g, u) = (g.min(limit), u.clamp(-limit, limit));
            (u + 1.0) * (g / (1.0 + (-g * alpha).exp()))
        }
    }
}

