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
