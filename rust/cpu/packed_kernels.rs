//! The packed matmul's kernels (`packed.rs` holds the layout and the loop
//! over tasks): for one group of eight weight rows (two, on 512-bit
//! vectors) and up to eight activation rows a call, every block's integer
//! dot products, then their scales. A scalar reference, AVX2, AVX-512 VNNI on
//! 256- and 512-bit vectors; every one gives the reference's bits.

use crate::cpu::packed_layout::{high_bits, lane_scales, read_quant, Packing, BLOCK, LANES};
use crate::cpu::simd::Isa;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// The most activation rows one kernel call takes.
pub(super) const MAX_ROWS: usize = 8;

/// One kernel call: a group's records, and up to MAX_ROWS activation rows
/// with where their eight outputs go.
pub(super) struct Tile {
    pub(super) rec: *const u8,
    pub(super) record: usize,
    /// the group's super-block scales (K-quants), `super_bytes` per eight blocks
    pub(super) sup: *const u8,
    pub(super) super_bytes: usize,
    pub(super) blocks: usize,
    pub(super) q: [*const i8; MAX_ROWS],
    /// the rows' q + 128 (VNNI only; null elsewhere)
    pub(super) u: [*const u8; MAX_ROWS],
    pub(super) d: [*const f32; MAX_ROWS],
    pub(super) s: [*const f32; MAX_ROWS],
    pub(super) out: [*mut f32; MAX_ROWS],
}

#[derive(Clone, Copy)]
pub(super) struct Kernel {
    /// activation rows per call at most
    pub(super) rows: usize,
    pub(super) run: unsafe fn(&Tile, usize),
    /// the tile's group and the next one together (both whole), their sixteen outputs a row adjacent
    pub(super) pair: Option<unsafe fn(&Tile, usize)>,
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

pub(super) fn kernel_for(p: Packing, isa: Isa) -> Kernel {
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

/// The integer vectors the SIMD kernels work on, and their float vectors: one
/// group's 32-byte vectors (`__m256i`), or two groups' side by side (`__m512i`:
/// the tile's group in the low half, the next one's, `next` bytes on in the
/// records, in the high half). Each output lane goes through the same
/// operations either way, so both give the same bits.
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    type F: Copy;
    /// 32 bytes a group: at `at` (and `at + next`).
    unsafe fn load(at: *const u8, next: usize) -> Self;
    /// Eight f32s, f16s widened, or i8s as f32s, a group.
    unsafe fn load_f32(at: *const u8, next: usize) -> Self::F;
    unsafe fn load_f16(at: *const u8, next: usize) -> Self::F;
    unsafe fn load_i8(at: *const u8, next: usize) -> Self::F;
    unsafe fn splat8(x: i8) -> Self;
    /// Four bytes at `at` in every 32-bit lane.
    unsafe fn broadcast4(at: *const u8) -> Self;
    unsafe fn and(a: Self, b: Self) -> Self;
    unsafe fn or(a: Self, b: Self) -> Self;
    unsafe fn sub8(a: Self, b: Self) -> Self;
    /// Every bit `n` places up (down where `n` < 0), in 16- or 32-bit units: the bits a byte
    /// takes from its neighbour are the ones callers mask away.
    unsafe fn shift(x: Self, n: i32) -> Self;
    /// VNNI: acc plus the four u8 · i8 products of each 32-bit lane.
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self;
    /// a - 128 · b, in 32-bit lanes.
    unsafe fn less_128_times(a: Self, b: Self) -> Self;
    unsafe fn zero() -> Self;
    unsafe fn fzero() -> Self::F;
    unsafe fn fsplat(x: f32) -> Self::F;
    unsafe fn fmul(a: Self::F, b: Self::F) -> Self::F;
    /// a · b + c, fused.
    unsafe fn fmadd(a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    unsafe fn to_f32(x: Self) -> Self::F;
    unsafe fn store(at: *mut f32, x: Self::F);
}

#[cfg(target_arch = "x86_64")]
impl Lanes for __m256i {
    type F = __m256;
    #[inline(always)]
    unsafe fn load(at: *const u8, _: usize) -> Self {
        _mm256_loadu_si256(at as *const __m256i)
    }
    #[inline(always)]
    unsafe fn load_f32(at: *const u8, _: usize) -> __m256 {
        _mm256_loadu_ps(at as *const f32)
    }
    #[inline(always)]
    unsafe fn load_f16(at: *const u8, _: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i))
    }
    #[inline(always)]
    unsafe fn load_i8(at: *const u8, _: usize) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(at as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn splat8(x: i8) -> Self {
        _mm256_set1_epi8(x)
    }
    #[inline(always)]
    unsafe fn broadcast4(at: *const u8) -> Self {
        _mm256_set1_epi32((at as *const i32).read_unaligned())
    }
    #[inline(always)]
    unsafe fn and(a: Self, b: Self) -> Self {
        _mm256_and_si256(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        _mm256_or_si256(a, b)
    }
    #[inline(always)]
    unsafe fn sub8(a: Self, b: Self) -> Self {
        _mm256_sub_epi8(a, b)
    }
    #[inline(always)]
    unsafe fn shift(x: Self, n: i32) -> Self {
        if n >= 0 {
            _mm256_sll_epi16(x, _mm_cvtsi32_si128(n))
        } else {
            _mm256_srl_epi16(x, _mm_cvtsi32_si128(-n))
        }
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self {
        _mm256_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn less_128_times(a: Self, b: Self) -> Self {
        _mm256_sub_epi32(a, _mm256_slli_epi32(b, 7))
    }
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm256_setzero_si256()
    }
    #[inline(always)]
    unsafe fn fzero() -> __m256 {
        _mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn fsplat(x: f32) -> __m256 {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m256, b: __m256) -> __m256 {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m256, b: __m256, c: __m256) -> __m256 {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn to_f32(x: Self) -> __m256 {
        _mm256_cvtepi32_ps(x)
    }
    #[inline(always)]
    unsafe fn store(at: *mut f32, x: __m256) {
        _mm256_storeu_ps(at, x)
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for __m512i {
    type F = __m512;
    #[inline(always)]
    unsafe fn load(at: *const u8, next: usize) -> Self {
        let first = _mm512_castsi256_si512(_mm256_loadu_si256(at as *const __m256i));
        _mm512_inserti64x4::<1>(first, _mm256_loadu_si256(at.add(next) as *const __m256i))
    }
    #[inline(always)]
    unsafe fn load_f32(at: *const u8, next: usize) -> __m512 {
        _mm512_castsi512_ps(Self::load(at, next))
    }
    #[inline(always)]
    unsafe fn load_f16(at: *const u8, next: usize) -> __m512 {
        let halves = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(at as *const __m128i)),
            _mm_loadu_si128(at.add(next) as *const __m128i),
        );
        _mm512_cvtph_ps(halves)
    }
    #[inline(always)]
    unsafe fn load_i8(at: *const u8, next: usize) -> __m512 {
        let both = _mm_unpacklo_epi64(_mm_loadl_epi64(at as *const __m128i), _mm_loadl_epi64(at.add(next) as *const __m128i));
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both))
    }
    #[inline(always)]
    unsafe fn splat8(x: i8) -> Self {
        _mm512_set1_epi8(x)
    }
    #[inline(always)]
    unsafe fn broadcast4(at: *const u8) -> Self {
        _mm512_set1_epi32((at as *const i32).read_unaligned())
    }
    #[inline(always)]
    unsafe fn and(a: Self, b: Self) -> Self {
        _mm512_and_si512(a, b)
    }
    #[inline(always)]
    unsafe fn or(a: Self, b: Self) -> Self {
        _mm512_or_si512(a, b)
    }
    #[inline(always)]
    unsafe fn sub8(a: Self, b: Self) -> Self {
        _mm512_sub_epi8(a, b)
    }
    #[inline(always)]
    unsafe fn shift(x: Self, n: i32) -> Self {
        if n >= 0 {
            _mm512_sll_epi32(x, _mm_cvtsi32_si128(n))
        } else {
            _mm512_srl_epi32(x, _mm_cvtsi32_si128(-n))
        }
    }
    #[inline(always)]
    unsafe fn dpbusd(acc: Self, a: Self, b: Self) -> Self {
        _mm512_dpbusd_epi32(acc, a, b)
    }
    #[inline(always)]
    unsafe fn less_128_times(a: Self, b: Self) -> Self {
        _mm512_sub_epi32(a, _mm512_slli_epi32::<7>(b))
    }
    #[inline(always)]
    unsafe fn zero() -> Self {
        _mm512_setzero_si512()
    }
    #[inline(always)]
    unsafe fn fzero() -> __m512 {
        _mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn fsplat(x: f32) -> __m512 {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fmul(a: __m512, b: __m512) -> __m512 {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: __m512, b: __m512, c: __m512) -> __m512 {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn to_f32(x: Self) -> __m512 {
        _mm512_cvtepi32_ps(x)
    }
    #[inline(always)]
    unsafe fn store(at: *mut f32, x: __m512) {
        _mm512_storeu_ps(at, x)
    }
}

/// A block's scales for its lanes (one per sub-block) and their offsets: f16s, or
/// (K-quants) 8-bit integers times the lane's super-block scale.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn block_scales<V: Lanes, const SUBS: usize, const MIN: bool, const HALF: bool>(t: &Tile, b: usize, p: Packing) -> ([V::F; 2], V::F) {
    let (rec, sup) = (t.rec.add(b * t.record), t.sup.add(b / 8 * t.super_bytes));
    let (next, next_sup) = (t.blocks * t.record, t.blocks.div_ceil(8) * t.super_bytes);
    let load = |at: *const u8, base: *const u8| {
        if HALF {
            V::load_f16(at, next)
        } else {
            V::fmul(V::load_f32(base, next_sup), V::load_i8(at, next))
        }
    };
    let mut dw = [V::fzero(); 2];
    for (s, d) in dw.iter_mut().enumerate().take(SUBS) {
        *d = load(rec.add(s * LANES * p.scale_bytes()), sup);
    }
    let m = if MIN { load(rec.add(p.mins_at()), sup.add(4 * LANES)) } else { V::fzero() };
    (dw, m)
}

/// The float part of a block, the same in every kernel: for each sub-block,
/// acc += (d_w · d_a) · isum, then acc += m_w · s_a.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn accumulate<V: Lanes, const SUBS: usize, const MIN: bool>(
    (dw, m): ([V::F; 2], V::F),
    isum: &[V; 2],
    da: f32,
    sa: f32,
    acc: V::F,
) -> V::F {
    let mut acc = acc;
    let da = V::fsplat(da);
    for (s, sum) in isum.iter().enumerate().take(SUBS) {
        acc = V::fmadd(V::fmul(dw[s], da), V::to_f32(*sum), acc);
    }
    if MIN {
        acc = V::fmadd(m, V::fsplat(sa), acc);
    }
    acc
}

/// Chunk `j` of a block's values: its low nibbles (values 4j..4j+4 of each
/// lane's row) and its high ones (values 16+4j..), each with its high bits
/// (`high_bits`, in place above the nibble); Q6_K's less 32.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn values<V: Lanes, const HIGH: usize>(rec: *const u8, next: usize, p: Packing, j: usize) -> [V; 2] {
    let low = V::splat8(0x0F);
    let raw = V::load(rec.add(p.quants_at() + 32 * j), next);
    let (lo, hi) = (V::and(raw, low), V::and(V::shift(raw, -4), low));
    if HIGH == 0 {
        return [lo, hi];
    }
    let above = |v: usize| {
        let (plane, shift) = high_bits(HIGH, v);
        let x = V::load(rec.add(p.planes_at() + plane), next);
        V::and(V::shift(x, 4 - shift as i32), V::splat8((((1 << HIGH) - 1) << 4) as i8))
    };
    let (lo, hi) = (V::or(lo, above(2 * j)), V::or(hi, above(2 * j + 1)));
    if HIGH == 2 {
        let k = V::splat8(32);
        return [V::sub8(lo, k), V::sub8(hi, k)];
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
                for (s, w) in values::<__m256i, HIGH>(rec, 0, p, j).into_iter().enumerate() {
                    let wa = _mm256_abs_epi8(w);
                    for r in 0..R {
                        let a = __m256i::broadcast4(t.q[r].add(b * BLOCK + 16 * s + 4 * j) as *const u8);
                        p16[r][s] = _mm256_add_epi16(p16[r][s], _mm256_maddubs_epi16(wa, _mm256_sign_epi8(a, w)));
                    }
                }
            }
            widen(&mut p16, &mut isum);
        } else if NIB {
            for j in 0..4 {
                let [lo, hi] = values::<__m256i, HIGH>(rec, 0, p, j);
                for r in 0..R {
                    let a = t.q[r].add(b * BLOCK);
                    let x = _mm256_maddubs_epi16(lo, __m256i::broadcast4(a.add(4 * j) as *const u8));
                    let y = _mm256_maddubs_epi16(hi, __m256i::broadcast4(a.add(16 + 4 * j) as *const u8));
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
                    let a = __m256i::broadcast4(t.q[r].add(b * BLOCK + 4 * g) as *const u8);
                    let prod = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(a, w));
                    isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(prod, ones));
                }
            }
        }
        let scales = block_scales::<__m256i, SUBS, MIN, HALF>(t, b, p);
        for r in 0..R {
            acc[r] = accumulate::<__m256i, SUBS, MIN>(scales, &isum[r], *t.d[r].add(b), *t.s[r].add(b), acc[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(t.out[r], acc[r]);
    }
}

/// The VNNI kernel, on one group's 256-bit vectors or two groups' 512-bit ones (`Lanes`).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn vnni_body<V: Lanes, const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    let p = Packing { nibbles: NIB, high: HIGH, subs: SUBS, min: MIN, half: HALF };
    let next = t.blocks * t.record;
    let (ones8, zero) = (V::splat8(1), V::zero());
    let mut acc = [V::fzero(); R];
    for b in 0..t.blocks {
        let rec = t.rec.add(b * t.record);
        let mut isum = [[zero; 2]; R];
        // signed values: (a + 128) · w summed, less 128 · Σw (the activations as the unsigned operand)
        let mut wsum = [zero; 2];
        let signed = |w: V, s: usize, at: usize, wsum: &mut [V; 2], isum: &mut [[V; 2]; R]| {
            wsum[s] = V::dpbusd(wsum[s], ones8, w);
            for r in 0..R {
                isum[r][s] = V::dpbusd(isum[r][s], V::broadcast4(t.u[r].add(b * BLOCK + at)), w);
            }
        };
        if NIB && HIGH == 2 {
            // sub-block 0 is the low nibbles' values
            for j in 0..4 {
                for (s, w) in values::<V, HIGH>(rec, next, p, j).into_iter().enumerate() {
                    signed(w, s, 16 * s + 4 * j, &mut wsum, &mut isum);
                }
            }
        } else if NIB {
            for j in 0..4 {
                let [lo, hi] = values::<V, HIGH>(rec, next, p, j);
                for r in 0..R {
                    let a = t.q[r].add(b * BLOCK) as *const u8;
                    isum[r][0] = V::dpbusd(isum[r][0], lo, V::broadcast4(a.add(4 * j)));
                    isum[r][0] = V::dpbusd(isum[r][0], hi, V::broadcast4(a.add(16 + 4 * j)));
                }
            }
        } else {
            let qs = rec.add(p.quants_at());
            for g in 0..8 {
                signed(V::load(qs.add(32 * g), next), 0, 4 * g, &mut wsum, &mut isum);
            }
        }
        if !NIB || HIGH == 2 {
            for r in 0..R {
                for s in 0..SUBS {
                    isum[r][s] = V::less_128_times(isum[r][s], wsum[s]);
                }
            }
        }
        let scales = block_scales::<V, SUBS, MIN, HALF>(t, b, p);
        for r in 0..R {
            acc[r] = accumulate::<V, SUBS, MIN>(scales, &isum[r], *t.d[r].add(b), *t.s[r].add(b), acc[r]);
        }
    }
    for r in 0..R {
        V::store(t.out[r], acc[r]);
    }
}

/// AVX-512 VNNI on 256-bit vectors: the tile's group.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn vnni_tile<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    vnni_body::<__m256i, NIB, HIGH, SUBS, MIN, HALF, R>(t)
}

/// AVX-512 VNNI on 512-bit vectors: the tile's group and the next, sixteen weight rows at once.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn vnni512_pair<const NIB: bool, const HIGH: usize, const SUBS: usize, const MIN: bool, const HALF: bool, const R: usize>(
    t: &Tile,
) {
    vnni_body::<__m512i, NIB, HIGH, SUBS, MIN, HALF, R>(t)
}
