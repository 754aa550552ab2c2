//! How a packed matrix's block record is laid out (`packed.rs` writes it,
//! `packed_kernels.rs` reads it): the packings, where each part of a record
//! lies, a lane's scales and values as the scalar reference reads them, and
//! the f16 conversions the scales need.

pub use crate::cpu::activations::BLOCK;

/// Weight rows interleaved per block.
pub const LANES: usize = 8;

/// How a packed matrix stores a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Packing {
    /// 4-bit unsigned values (else 8-bit signed)
    pub(super) nibbles: bool,
    /// with `nibbles`, bits of each value above its nibble, in planes after
    /// them (`high_bits`): 0; 1 (Q5: 5-bit unsigned values, with an
    /// offset); or 2 (Q6_K: 6-bit values less 32, signed). A Q5 value then
    /// takes 6 bits and a Q6_K value 6.6, where a byte would take 8.5
    pub(super) high: usize,
    /// scales per row and block: 1, or 2 (one per 16 columns)
    pub(super) subs: usize,
    /// a per-row, per-block offset: w = d·q + m
    pub(super) min: bool,
    /// scales and offsets as f16 (the source's own, kept exactly); else (the
    /// K-quants) as the source's own 6- or 8-bit integers, each times its
    /// lane's f32 scale (offsets: the negated offset scale) of the 256-column
    /// super-block, in a table after the records (`super_bytes`): the
    /// product ggml's dequantization forms, exact in f32
    pub(super) half: bool,
}

impl Packing {
    pub(super) fn scale_bytes(self) -> usize {
        if self.half {
            2
        } else {
            1
        }
    }
    /// Bytes of one group's super-block scales (per eight blocks): each lane's scale, and offset scale.
    pub(super) fn super_bytes(self) -> usize {
        if self.half {
            0
        } else {
            LANES * 4 * (1 + self.min as usize)
        }
    }
    /// Bytes of a [rows, blocks · 32] matrix: its records, then its super-block scales.
    pub(super) fn matrix_bytes(self, rows: usize, blocks: usize) -> usize {
        rows.div_ceil(LANES) * (blocks * self.record() + blocks.div_ceil(8) * self.super_bytes())
    }
    pub(super) fn mins_at(self) -> usize {
        LANES * self.subs * self.scale_bytes()
    }
    pub(super) fn quants_at(self) -> usize {
        self.mins_at() + if self.min { LANES * self.scale_bytes() } else { 0 }
    }
    /// Where the planes of high bits start (`high_bits`).
    pub(super) fn planes_at(self) -> usize {
        self.quants_at() + LANES * BLOCK / 2
    }
    /// Bytes of one block of eight rows.
    pub(super) fn record(self) -> usize {
        self.quants_at() + if self.nibbles { LANES * BLOCK / 2 + 32 * self.high } else { LANES * BLOCK }
    }
}

/// Where the high bits of a value in a block's nibbles are: the nibbles are
/// eight 32-byte vectors (`nibbles`: chunk j's low nibbles are vector 2j,
/// its high ones 2j + 1), and byte k of a 32-byte plane holds the high bits
/// of byte k of 8 / `high` vectors, vector v's at bit (v mod 8/high)·high of
/// plane v / (8/high). So a kernel gets vector v's high bits in place (bit 4
/// up) with one shift and one mask, on AVX2 as on AVX-512.
pub(super) fn high_bits(high: usize, v: usize) -> (usize, usize) {
    let per = 8 / high;
    (32 * (v / per), (v % per) * high)
}


/// A lane's scales (one per sub-block) and offset in a block's record, with its super-block's scales `sup`.
pub(super) fn lane_scales(p: Packing, rec: &[u8], sup: &[u8], lane: usize) -> ([f32; 2], f32) {
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
pub(super) fn read_quant(p: Packing, rec: &[u8], lane: usize, i: usize) -> i32 {
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
pub(super) fn f32_to_f16_exact(x: f32) -> Option<u16> {
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
