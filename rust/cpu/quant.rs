//! Quantized matmul on the CPU: `y = x · Wᵀ` for f32 activations `x`
//! [batch, cols] and a weight `W` [rows, cols] given in one of ggml's block
//! formats (a GGUF tensor's bytes as stored).
//!
//! Where the format has a packing (`packed.rs`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! Q4_K, Q5_K, Q6_K), the matrix is repacked at construction and multiplied
//! by the multi-row kernels there; the GGUF bytes are not kept. The other
//! formats (Q2_K, Q3_K) keep their bytes and go through ggml's own one-row
//! `vec_dot` (built from ggml's sources by `rust/build.rs`): the activations
//! are first quantized to the format the dot product pairs with (Q8_0, Q8_1
//! or Q8_K), then every output is one dot product of a weight row with an
//! activation row. Either way a row's result does not depend on the other
//! rows of the call. The threads are `pool.rs`'s.
//!
//! The kernels come in one build per x86 ISA level; [`kernels`] picks the best
//! one this CPU runs, once. Where none does (not x86, or no AVX2),
//! [`available`] is false and callers keep dense weights.

use std::borrow::Cow;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::cpu::activations::Activations;
use crate::cpu::packed::{f16_to_f32, PackedMatrix, Records};
use crate::threads::pool::{self, SendPtr};

type VecDot = unsafe extern "C" fn(c_int, *mut f32, usize, *const c_void, usize, *const c_void, usize, c_int);
type Quantize = unsafe extern "C" fn(*const f32, *mut c_void, i64);
type ToFloat = unsafe extern "C" fn(*const c_void, *mut f32, i64);

#[repr(C)]
struct TypeTraits {
    type_name: *const std::ffi::c_char,
    blck_size: i64,
    blck_size_interleave: i64,
    type_size: usize,
    is_quantized: bool,
    to_float: Option<ToFloat>,
    from_float_ref: Option<Quantize>,
}

extern "C" {
    fn guided_ggml_init();
    fn ggml_get_type_traits(ty: c_int) -> *const TypeTraits;
}

/// The activation formats the dot products pair with (ggml type ids).
const Q8_0: u32 = 8;
const Q8_1: u32 = 9;
const Q8_K: u32 = 15;

/// The weight formats supported: ggml type id, name, activation format.
/// Every one has an AVX2 dot product in ggml's x86 kernels.
pub const FORMATS: &[(u32, &str, u32)] = &[
    (2, "Q4_0", Q8_0),
    (3, "Q4_1", Q8_1),
    (6, "Q5_0", Q8_0),
    (7, "Q5_1", Q8_1),
    (8, "Q8_0", Q8_0),
    (10, "Q2_K", Q8_K),
    (11, "Q3_K", Q8_K),
    (12, "Q4_K", Q8_K),
    (13, "Q5_K", Q8_K),
    (14, "Q6_K", Q8_K),
];

/// One ISA level's build of the kernels.
pub struct Kernels {
    pub level: &'static str,
    dots: [VecDot; FORMATS.len()],
    quantize: [Quantize; 3], // Q8_0, Q8_1, Q8_K
}

macro_rules! level {
    ($module:ident, $level:literal) => {
        mod $module {
            use super::*;
            extern "C" {
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q4_0_q8_0")] fn q4_0(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q4_1_q8_1")] fn q4_1(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q5_0_q8_0")] fn q5_0(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q5_1_q8_1")] fn q5_1(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q8_0_q8_0")] fn q8_0(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q2_K_q8_K")] fn q2_k(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q3_K_q8_K")] fn q3_k(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q4_K_q8_K")] fn q4_k(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q5_K_q8_K")] fn q5_k(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_ggml_vec_dot_q6_K_q8_K")] fn q6_k(n: c_int, s: *mut f32, bs: usize, x: *const c_void, bx: usize, y: *const c_void, by: usize, nrc: c_int);
                #[link_name = concat!("guided_", $level, "_quantize_row_q8_0")] fn quantize_q8_0(x: *const f32, y: *mut c_void, k: i64);
                #[link_name = concat!("guided_", $level, "_quantize_row_q8_1")] fn quantize_q8_1(x: *const f32, y: *mut c_void, k: i64);
                #[link_name = concat!("guided_", $level, "_quantize_row_q8_K")] fn quantize_q8_k(x: *const f32, y: *mut c_void, k: i64);
            }
            pub fn kernels() -> Kernels {
                Kernels {
                    level: $level,
                    dots: [q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k],
                    quantize: [quantize_q8_0, quantize_q8_1, quantize_q8_k],
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
level!(avx2, "avx2");
#[cfg(target_arch = "x86_64")]
level!(avx512, "avx512");

/// The best build of the kernels this CPU runs, or None.
pub fn kernels() -> Option<&'static Kernels> {
    static BEST: OnceLock<Option<Kernels>> = OnceLock::new();
    BEST.get_or_init(|| {
        let best = pick();
        if best.is_some() {
            unsafe { guided_ggml_init() };
        }
        best
    })
    .as_ref()
}

#[cfg(target_arch = "x86_64")]
fn pick() -> Option<Kernels> {
    let avx2 = ["avx2", "fma", "f16c", "bmi2"].iter().all(|f| has(f));
    let avx512 = avx2 && ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"].iter().all(|f| has(f));
    if avx512 {
        Some(avx512::kernels())
    } else if avx2 {
        Some(avx2::kernels())
    } else {
        None
    }
}

#[cfg(target_arch = "x86_64")]
fn has(feature: &str) -> bool {
    match feature {
        "avx2" => is_x86_feature_detected!("avx2"),
        "fma" => is_x86_feature_detected!("fma"),
        "f16c" => is_x86_feature_detected!("f16c"),
        "bmi2" => is_x86_feature_detected!("bmi2"),
        "avx512f" => is_x86_feature_detected!("avx512f"),
        "avx512bw" => is_x86_feature_detected!("avx512bw"),
        "avx512vl" => is_x86_feature_detected!("avx512vl"),
        "avx512dq" => is_x86_feature_detected!("avx512dq"),
        "avx512vnni" => is_x86_feature_detected!("avx512vnni"),
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn pick() -> Option<Kernels> {
    None
}

pub fn available() -> bool {
    kernels().is_some()
}

/// A block format's shape: elements per block and bytes per block.
#[derive(Clone, Copy)]
struct Block {
    elements: usize,
    bytes: usize,
}

impl Block {
    fn of(ty: u32) -> Block {
        // only called for the ids in FORMATS and the Q8 activation formats, all known to ggml
        let t = unsafe { &*ggml_get_type_traits(ty as c_int) };
        Block { elements: t.blck_size as usize, bytes: t.type_size }
    }

    /// ggml's dequantization of a format, where it has one (not for Q8_1 and Q8_K).
    fn to_float(ty: u32) -> Option<ToFloat> {
        unsafe { &*ggml_get_type_traits(ty as c_int) }.to_float
    }

    fn row_bytes(self, cols: usize) -> usize {
        cols / self.elements * self.bytes
    }
}

enum Storage {
    Packed(PackedMatrix),
    /// ggml rows as given, for ggml's `vec_dot`
    Ggml(Vec<u8>),
}

/// `dense` [rows, cols] as ggml rows of format `ty`, by ggml's reference quantizer.
pub fn quantize_rows(ty: u32, rows: usize, cols: usize, dense: &[f32]) -> Result<Vec<u8>, String> {
    assert_eq!(dense.len(), rows * cols, "quantize shape");
    if kernels().is_none() {
        return Err("this CPU has no build of ggml's quantized kernels (x86-64 with AVX2 needed)".into());
    }
    let format = FORMATS.iter().position(|f| f.0 == ty).map(|i| FORMATS[i]);
    let from_float = format
        .and_then(|f| unsafe { &*ggml_get_type_traits(f.0 as c_int) }.from_float_ref)
        .ok_or_else(|| format!("ggml type {ty} has no quantizer here"))?;
    let block = Block::of(ty);
    if cols % block.elements != 0 {
        return Err(format!("{cols} columns are not whole {}-element blocks", block.elements));
    }
    let row_bytes = block.row_bytes(cols);
    let mut data = vec![0u8; rows * row_bytes];
    data.par_chunks_mut(row_bytes).zip(dense.par_chunks(cols)).for_each(|(dst, src)| unsafe {
        from_float(src.as_ptr(), dst.as_mut_ptr().cast(), cols as i64)
    });
    Ok(data)
}

/// A weight matrix [rows, cols] in a ggml block format: packed for the
/// multi-row kernels, or its ggml rows as stored.
pub struct QuantMatrix {
    storage: Storage,
    format: usize, // index into FORMATS
    pub rows: usize,
    pub cols: usize,
    row_bytes: usize,
    act: (usize, Block), // activation format: index into Kernels::quantize, and its block
}

impl QuantMatrix {
    /// `data`: the rows as ggml stores them; borrowed where the format packs (the packing is a
    /// new layout), kept as given where it does not.
    pub fn new<'a>(ty: u32, rows: usize, cols: usize, data: impl Into<Cow<'a, [u8]>>) -> Result<Self, String> {
        let data = data.into();
        let format = FORMATS.iter().position(|f| f.0 == ty).ok_or_else(|| {
            let names: Vec<&str> = FORMATS.iter().map(|f| f.1).collect();
            format!("ggml type {ty} has no quantized CPU kernel here (supported: {})", names.join(", "))
        })?;
        if kernels().is_none() {
            return Err("this CPU has no build of ggml's quantized kernels (x86-64 with AVX2 needed)".into());
        }
        let block = Block::of(ty);
        let act_ty = FORMATS[format].2;
        let act = ([Q8_0, Q8_1, Q8_K].iter().position(|&t| t == act_ty).unwrap(), Block::of(act_ty));
        for (what, b) in [(FORMATS[format].1, block), ("its activations", act.1)] {
            if cols % b.elements != 0 {
                return Err(format!("{cols} columns are not whole {}-element blocks of {what}", b.elements));
            }
        }
        let row_bytes = block.row_bytes(cols);
        if data.len() != rows * row_bytes {
            return Err(format!(
                "{} bytes given for a [{rows}, {cols}] {} matrix, which takes {}",
                data.len(),
                FORMATS[format].1,
                rows * row_bytes
            ));
        }
        let storage = match PackedMatrix::pack(ty, rows, cols, &data, row_bytes) {
            Some(packed) => Storage::Packed(packed),
            None => Storage::Ggml(data.into_owned()),
        };
        Ok(QuantMatrix { storage, format, rows, cols, row_bytes, act })
    }

    /// A matrix packed earlier (`packed().bytes()` of one `new` made from the same format and
    /// shape), taken as it is: the load cache's way around repacking a GGUF at every start.
    pub fn from_packed(ty: u32, rows: usize, cols: usize, data: Records) -> Result<Self, String> {
        let (given, probe) = (data.len(), QuantMatrix::new(ty, 0, cols, Vec::new())?);
        let packed = PackedMatrix::from_packed(ty, rows, cols, data).ok_or_else(|| {
            format!("{given} bytes are not a packed [{rows}, {cols}] {} matrix", probe.format_name())
        })?;
        Ok(QuantMatrix { storage: Storage::Packed(packed), rows, ..probe })
    }

    /// `dense` [rows, cols] in format `ty`, by ggml's reference quantizer.
    pub fn quantize(ty: u32, rows: usize, cols: usize, dense: &[f32]) -> Result<Self, String> {
        QuantMatrix::new(ty, rows, cols, quantize_rows(ty, rows, cols, dense)?)
    }

    /// As `new`, but keeping ggml's rows and one-row kernel whatever the format (tests compare the two).
    #[cfg(test)]
    pub fn quantize_unpacked(ty: u32, rows: usize, cols: usize, data: Vec<u8>) -> Self {
        let mut m = QuantMatrix::new(ty, rows, cols, data.clone()).unwrap();
        m.storage = Storage::Ggml(data);
        m
    }

    pub fn format_name(&self) -> &'static str {
        FORMATS[self.format].1
    }

    /// The ggml type id of the format it was given in.
    pub fn ggml_type(&self) -> u32 {
        FORMATS[self.format].0
    }

    /// Whether the multi-row kernels run it (else ggml's one-row dot products).
    pub fn packed(&self) -> Option<&PackedMatrix> {
        match &self.storage {
            Storage::Packed(p) => Some(p),
            Storage::Ggml(_) => None,
        }
    }

    pub fn nbytes(&self) -> usize {
        match &self.storage {
            Storage::Packed(p) => p.nbytes(),
            Storage::Ggml(data) => data.len(),
        }
    }

    /// out[b, r] = Σ_c x[b, c] · W[r, c], for `x` [batch, cols] and `out` [batch, rows].
    ///
    /// With `precise`, the part of `x` the 8-bit activations lost is quantized
    /// too and multiplied in a second dot product: the result is then that of
    /// about 16-bit activations (where a near tie between two tokens must not
    /// flip on rounding).
    pub fn matmul(&self, x: &[f32], out: &mut [f32], precise: bool) {
        let batch = x.len() / self.cols;
        assert!(x.len() == batch * self.cols && out.len() == batch * self.rows, "matmul shapes");
        match &self.storage {
            Storage::Packed(p) => {
                let mut act = Activations::new();
                act.quantize(x, self.cols, precise);
                p.matmul(&act, out);
            }
            Storage::Ggml(data) => self.ggml_matmul(data, x, out, precise),
        }
    }

    /// The dense f32 matrix [rows, cols], by ggml's own dequantization (packed: the same values).
    pub fn dequantize(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.rows * self.cols, "dequantize shape");
        let cols = self.cols;
        match &self.storage {
            Storage::Packed(p) => out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| p.dequantize_row(r, row)),
            Storage::Ggml(data) => {
                let to_float = Block::to_float(FORMATS[self.format].0).expect("every weight format dequantizes");
                let row_bytes = self.row_bytes;
                out.par_chunks_mut(cols).enumerate().for_each(|(r, row)| unsafe {
                    to_float(data[r * row_bytes..].as_ptr().cast(), row.as_mut_ptr(), cols as i64)
                });
            }
        }
    }

    /// Row `r` as f32 (an embedding lookup in a quantized table): ggml's dequantized values.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let data = match &self.storage {
            Storage::Packed(p) => return p.dequantize_row(r, out),
            Storage::Ggml(data) => data,
        };
        let to_float = Block::to_float(FORMATS[self.format].0).expect("every weight format dequantizes");
        // SAFETY: row r is row_bytes of a format ggml dequantizes into `cols` values
        unsafe { to_float(data[r * self.row_bytes..].as_ptr().cast(), out.as_mut_ptr(), self.cols as i64) };
    }

    fn ggml_matmul(&self, data: &[u8], x: &[f32], out: &mut [f32], precise: bool) {
        let batch = x.len() / self.cols;
        let k = kernels().expect("checked in new");
        let act_ty = FORMATS[self.format].2;
        let (quantize, act) = (k.quantize[self.act.0], self.act.1);
        let act_row = act.row_bytes(self.cols);
        let passes = if precise { 2 } else { 1 };
        // [batch][pass] activation rows
        let mut xq = vec![0u8; batch * passes * act_row];
        let cols = self.cols;
        let quantize_row = |(src, dst): (&[f32], &mut [u8])| unsafe {
            quantize(src.as_ptr(), dst.as_mut_ptr().cast(), cols as i64);
            if precise {
                let mut rest = vec![0f32; cols];
                dequantize_activations(act_ty, act.bytes, dst, &mut rest);
                rest.iter_mut().zip(src).for_each(|(r, x)| *r = x - *r);
                quantize(rest.as_ptr(), dst[act_row..].as_mut_ptr().cast(), cols as i64);
            }
        };
        x.chunks(cols).zip(xq.chunks_mut(passes * act_row)).for_each(quantize_row);
        let dot = k.dots[self.format];
        let (rows, row_bytes) = (self.rows, self.row_bytes);
        let out_ptr = SendPtr(out.as_mut_ptr());
        // a few chunks per thread, so uneven threads even out; never under 16 rows
        let chunk = rows.div_ceil(4 * pool::threads()).max(16);
        pool::run(rows.div_ceil(chunk), &|c| {
            let out = out_ptr;
            for r in c * chunk..((c + 1) * chunk).min(rows) {
                let w = data[r * row_bytes..].as_ptr().cast();
                for b in 0..batch {
                    let mut sum = 0f32;
                    for p in 0..passes {
                        let mut s = 0f32;
                        let a = xq[(b * passes + p) * act_row..].as_ptr().cast();
                        unsafe { dot(cols as c_int, &mut s, 0, w, 0, a, 0, 1) };
                        sum += s;
                    }
                    // SAFETY: each (b, r) is written by exactly one task; `out` outlives the loop
                    unsafe { *out.0.add(b * rows + r) = sum };
                }
            }
        });
    }

}

/// An activation row in Q8_0, Q8_1 or Q8_K back to f32: every block is a
/// scale (f16, or f32 for Q8_K) first, then its 8-bit values (Q8_1 keeps a
/// sum between them, Q8_K sums after them); ggml dequantizes only Q8_0.
fn dequantize_activations(ty: u32, block_bytes: usize, src: &[u8], out: &mut [f32]) {
    let (values, per_block) = if ty == Q8_K { (4, 256) } else { (if ty == Q8_1 { 4 } else { 2 }, 32) };
    for (block, out) in src.chunks_exact(block_bytes).zip(out.chunks_exact_mut(per_block)) {
        let d = if ty == Q8_K {
            f32::from_le_bytes([block[0], block[1], block[2], block[3]])
        } else {
            f16_to_f32(u16::from_le_bytes([block[0], block[1]]))
        };
        for (o, &q) in out.iter_mut().zip(&block[values..values + per_block]) {
            *o = d * q as i8 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Q8_0 rows built by hand: the product equals the dense one up to the activations' 8-bit rounding.
    #[test]
    fn q8_0_matches_dense() {
        if !available() {
            return;
        }
        let (rows, cols) = (5, 64);
        let mut data = Vec::new();
        let mut dense = vec![0f32; rows * cols];
        for r in 0..rows {
            for blk in 0..cols / 32 {
                let d = (r + blk + 1) as f32 / 64.0; // exact in f16
                data.extend_from_slice(&f16_bits(d).to_le_bytes());
                for i in 0..32 {
                    let q = ((r * 7 + blk * 3 + i * 5) % 255) as i32 - 127;
                    data.push(q as i8 as u8);
                    dense[r * cols + blk * 32 + i] = d * q as f32;
                }
            }
        }
        let m = QuantMatrix::new(8, rows, cols, data).unwrap();
        let mut back = vec![0f32; rows * cols];
        m.dequantize(&mut back);
        for (a, b) in back.iter().zip(&dense) {
            assert!((a - b).abs() <= 1e-3 * b.abs().max(1.0), "{a} vs {b}");
        }
        let x: Vec<f32> = (0..2 * cols).map(|i| ((i * 13) % 17) as f32 / 17.0 - 0.5).collect();
        for (precise, tolerance) in [(false, 0.02), (true, 2e-4)] {
            let mut out = vec![0f32; 2 * rows];
            m.matmul(&x, &mut out, precise);
            for b in 0..2 {
                for r in 0..rows {
                    let want: f32 = (0..cols).map(|c| x[b * cols + c] * dense[r * cols + c]).sum();
                    let scale: f32 = (0..cols).map(|c| (x[b * cols + c] * dense[r * cols + c]).abs()).sum();
                    let got = out[b * rows + r];
                    assert!((got - want).abs() <= tolerance * scale, "precise={precise}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn bad_shapes_are_refused_with_their_reason() {
        if !available() {
            return;
        }
        assert!(QuantMatrix::new(3, 2, 33, vec![0; 40]).err().expect("refused").contains("blocks"));
        assert!(QuantMatrix::new(3, 2, 32, vec![0; 41]).err().expect("refused").contains("takes 40"));
        assert!(QuantMatrix::new(0, 2, 32, vec![0; 256]).err().expect("refused").contains("no quantized CPU kernel"));
    }

    /// A packing taken back from its bytes (the load cache) is the matrix it came from: the same
    /// products bit for bit; bytes of another size or a format without a packing are refused by name.
    #[test]
    fn a_packing_taken_back_multiplies_as_the_matrix_it_came_from() {
        if !available() {
            return;
        }
        let (rows, cols) = (13, 256);
        let dense: Vec<f32> = (0..rows * cols).map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0).collect();
        let x: Vec<f32> = (0..3 * cols).map(|i| ((i * 11) % 23) as f32 / 23.0 - 0.5).collect();
        for &(ty, name, _) in FORMATS.iter() {
            let m = QuantMatrix::quantize(ty, rows, cols, &dense).unwrap();
            let Some(packed) = m.packed() else {
                assert!(QuantMatrix::from_packed(ty, rows, cols, Records::Owned(vec![0; 64])).is_err(), "{name} has no packing");
                continue;
            };
            let back = QuantMatrix::from_packed(ty, rows, cols, Records::Owned(packed.bytes().to_vec())).unwrap();
            assert_eq!((back.rows, back.cols, back.ggml_type(), back.nbytes()), (rows, cols, ty, m.nbytes()), "{name}");
            for precise in [false, true] {
                let (mut want, mut got) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
                m.matmul(&x, &mut want, precise);
                back.matmul(&x, &mut got, precise);
                assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()), "{name} precise={precise}");
            }
            let short = packed.bytes()[1..].to_vec();
            let err = QuantMatrix::from_packed(ty, rows, cols, Records::Owned(short)).err().expect("one byte short");
            assert!(err.contains(name) && err.contains("[13, 256]"), "{err}");
        }
    }

    #[test]
    fn halves_convert_exactly() {
        for h in 0..=u16::MAX {
            let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
            let (exp, mant) = (((h >> 10) & 0x1f) as i32, (h & 0x3ff) as f64);
            let want = sign * match exp {
                0 => mant * 2f64.powi(-24),
                31 if mant == 0.0 => f64::INFINITY,
                31 => f64::NAN,
                e => (1.0 + mant / 1024.0) * 2f64.powi(e - 15),
            };
            let got = super::f16_to_f32(h);
            assert!(got == want as f32 || (got.is_nan() && want.is_nan()), "{h:#x}: {got} vs {want}");
        }
    }

    fn f16_bits(x: f32) -> u16 {
        // for normal values whose mantissa fits f16's 10 bits (the scales above)
        let bits = x.to_bits();
        let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
        let mant = (bits >> 13) & 0x3ff;
        ((exp as u32) << 10 | mant) as u16
    }
}
