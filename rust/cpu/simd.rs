//! What the CPU step's kernels share: the ISA they run with (picked once, at
//! run time), and small AVX2 building blocks: lane sums in a fixed order, and
//! e^x for eight lanes (attention's softmax, the activations).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The ISA the packed kernels run with here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors: eight weight rows at a time
    Vnni,
    /// AVX-512 VNNI on 512-bit vectors where two groups of eight rows are whole
    Vnni512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Vnni => "avx512_vnni",
            Isa::Vnni512 => "avx512_vnni_512",
        }
    }

    /// Whether the activations' `q + 128` copy is used (the VNNI kernels' unsigned operand).
    pub fn unsigned_activations(self) -> bool {
        matches!(self, Isa::Vnni | Isa::Vnni512)
    }
}

/// The ISA the packed kernels run with: AVX-512 VNNI on 512-bit vectors
/// where the CPU has it (and BW), else AVX2, else the scalar reference.
/// `GUIDED_PACKED_ISA=avx2` or `avx512_vnni` (256-bit vectors) picks a lesser one.
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
            let vnni = avx2 && has_vnni();
            let asked = std::env::var("GUIDED_PACKED_ISA");
            if asked.as_deref() == Ok("avx2") && avx2 {
                return Isa::Avx2;
            }
            if vnni && asked.as_deref() != Ok("avx512_vnni") && has_vnni512() {
                return Isa::Vnni512;
            }
            if vnni {
                return Isa::Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// Whether the CPU has what the VNNI kernels use: AVX-512 F, VL and VNNI.
pub fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has what the 512-bit VNNI kernels use besides `has_vnni`: AVX-512 BW.
pub fn has_vnni512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_vnni() && is_x86_feature_detected!("avx512bw")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AVX2 and FMA (asked once): the float kernels' own test.
pub fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static FAST: OnceLock<bool> = OnceLock::new();
        *FAST.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The sums of four vectors' lanes, each as ((s0 + s2) + (s1 + s3)) of s = low half + high half:
/// a vector's sum is the same bits whichever three others it is reduced with.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn hsum4(v: [__m256; 4]) -> [f32; 4] {
    let s = v.map(|x| _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1)));
    // transpose: column j holds lane j of each
    let t0 = _mm_unpacklo_ps(s[0], s[1]);
    let t1 = _mm_unpacklo_ps(s[2], s[3]);
    let t2 = _mm_unpackhi_ps(s[0], s[1]);
    let t3 = _mm_unpackhi_ps(s[2], s[3]);
    let (c0, c1, c2, c3) = (_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0), _mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2));
    let r = _mm_add_ps(_mm_add_ps(c0, c2), _mm_add_ps(c1, c3));
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), r);
    out
}

/// One vector's lane sum, as hsum4 sums it.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn hsum(v: __m256) -> f32 {
    hsum4([v; 4])[0]
}

/// x ← exp(x − max) for every x; returns their sum (eight partial sums, then those in a fixed order).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn exp_minus(x: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let body = x.len() / 8 * 8;
    let p = x.as_mut_ptr();
    let mut i = 0;
    while i < body {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
        _mm256_storeu_ps(p.add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut sum = hsum(acc);
    for v in &mut x[body..] {
        *v = exp8_one(*v - max);
        sum += *v;
    }
    sum
}

/// e^x for eight lanes, within a few ulp, x clamped to [−87, 88]: x = n·ln2 + r,
/// a degree-6 polynomial for e^r, then 2^n into the exponent.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(88.0));
    let n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // r = x − n·ln2, ln2 in two parts so r is exact enough
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut y = _mm256_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
    }
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    _mm256_mul_ps(y, scale)
}

/// exp8 for one value (the tail of a row), by the same operations.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn exp8_one(x: f32) -> f32 {
    _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)))
}


/// 1 / (1 + e^(−x)) for eight lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn sigmoid8(x: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))))
}

/// tanh(x) = 1 − 2 / (1 + e^(2x)) for eight lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn tanh8(x: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    let e = exp8(_mm256_add_ps(x, x));
    _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0), _mm256_add_ps(one, e)))
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn exp_sigmoid_and_tanh_are_within_a_few_ulp() {
        if !is_x86_feature_detected!("avx2") || !is_x86_feature_detected!("fma") {
            return;
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn check() {
            let mut x = -100.0f32;
            while x < 100.0 {
                let v = _mm256_set1_ps(x);
                let (e, s, t) = (_mm256_cvtss_f32(exp8(v)), _mm256_cvtss_f32(sigmoid8(v)), _mm256_cvtss_f32(tanh8(v)));
                let want = (x as f64).clamp(-87.0, 88.0).exp();
                assert!(((e as f64 - want) / want).abs() < 1e-6, "exp({x}) = {e}, not {want}");
                let sw = 1.0 / (1.0 + (-(x as f64)).exp());
                assert!((s as f64 - sw).abs() < 1e-6, "sigmoid({x}) = {s}, not {sw}");
                let tw = (x as f64).tanh();
                assert!((t as f64 - tw).abs() < 2e-6, "tanh({x}) = {t}, not {tw}");
                x += 0.037;
            }
        }
        unsafe { check() }
    }
}
