//! PyO3 bindings for the CUDA kernels (`cuda/launchers.rs`) and their CPU references
//! (`cuda/reference.rs`). Translation and argument checks only.
//!
//! A tensor crosses as `(data_ptr, shape, dtype, device, contiguous)`
//! (python/guided/cuda_ops.py builds it from a torch tensor), so the checks
//! below run, and are tested, on machines without a GPU.

use numpy::{IntoPyArray, PyArray1, PyArray3, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::cpu::cpu_attention::Layout;
use crate::cuda::reference::{self, Adjustments, DecodeScores, DecodeShape, RowParams, SamplePointers};

/// A torch tensor as the launchers see it: (data_ptr, shape, dtype, device,
/// contiguous).
#[derive(FromPyObject)]
pub struct TensorArg(u64, Vec<usize>, String, String, bool);

impl TensorArg {
    fn ptr(&self) -> u64 {
        self.0
    }
    fn shape(&self) -> &[usize] {
        &self.1
    }
    fn dtype(&self) -> &str {
        &self.2
    }
    fn device(&self) -> &str {
        &self.3
    }
    fn contiguous(&self) -> bool {
        self.4
    }
}

/// Checks one tensor argument: on the call's CUDA device, contiguous, of
/// `dtype` (None: any the kernels take) and `shape` (None in a dimension:
/// any). Returns its pointer.
fn expect(t: &TensorArg, name: &str, device: &str, dtype: Option<&str>, shape: &[Option<usize>]) -> PyResult<u64> {
    let err = |m: String| Err(PyValueError::new_err(format!("{name}: {m}")));
    if !t.device().starts_with("cuda") {
        return err(format!("must be on a CUDA device, is on {}", t.device()));
    }
    if t.device() != device {
        return err(format!("is on {} but the call's first tensor is on {device}", t.device()));
    }
    if !t.contiguous() {
        return err("must be contiguous".into());
    }
    if let Some(d) = dtype {
        if t.dtype() != d {
            return err(format!("must be {d}, is {}", t.dtype()));
        }
    }
    let fits = t.shape().len() == shape.len() && t.shape().iter().zip(shape).all(|(&a, b)| b.is_none_or(|b| a == b));
    if !fits {
        let want: Vec<String> = shape.iter().map(|d| d.map_or("*".into(), |d| d.to_string())).collect();
        return err(format!("has shape {:?}, expected [{}]", t.shape(), want.join(", ")));
    }
    Ok(t.ptr())
}

/// The logits [rows, vocab] float32 of a sampling call: (device, rows,
/// vocab, pointer); the call's other tensors must be on that device.
fn logits_arg(logits: &TensorArg) -> PyResult<(String, usize, usize, u64)> {
    let dev = logits.device().to_string();
    let [rows, vocab] = logits.shape()[..] else {
        return Err(PyValueError::new_err(format!("logits: has shape {:?}, expected [rows, vocab]", logits.shape())));
    };
    let ptr = expect(logits, "logits", &dev, Some("torch.float32"), &[Some(rows), Some(vocab)])?;
    Ok((dev, rows, vocab, ptr))
}

#[cfg(feature = "cuda")]
fn dtype_of(t: &TensorArg) -> PyResult<crate::cuda::launchers::Dtype> {
    crate::cuda::launchers::Dtype::parse(&t.dtype()).map_err(PyValueError::new_err)
}

#[cfg(not(feature = "cuda"))]
fn dtype_of(t: &TensorArg) -> PyResult<()> {
    match t.dtype() {
        "torch.float32" | "torch.float16" | "torch.bfloat16" => Ok(()),
        other => Err(PyValueError::new_err(format!("dtype {other} is not one the kernels are built for"))),
    }
}

#[cfg(not(feature = "cuda"))]
const NO_CUDA: &str = "this build of guided has no CUDA kernels (built without the cuda feature)";

fn launched(result: Result<(), String>) -> PyResult<()> {
    result.map_err(PyRuntimeError::new_err)
}

/// (True, "") when the kernels can run here, else (False, why not).
#[pyfunction]
pub fn cuda_status() -> (bool, String) {
    #[cfg(feature = "cuda")]
    return match crate::cuda::launchers::available() {
        Ok(()) => (true, String::new()),
        Err(why) => (false, why),
    };
    #[cfg(not(feature = "cuda"))]
    (false, NO_CUDA.to_string())
}

/// The embedded kernel files and their fatbin sizes (empty without the feature).
#[pyfunction]
pub fn cuda_kernel_files() -> Vec<(String, usize)> {
    #[cfg(feature = "cuda")]
    return crate::cuda::launchers::kernel_files().into_iter().map(|(s, n)| (s.to_string(), n)).collect();
    #[cfg(not(feature = "cuda"))]
    Vec::new()
}

/// Decode attention over the paged cache. q and out [seqs, heads, head];
/// caches [blocks, block_size, kv_heads, head] of q's dtype; block_tables
/// [seqs, max_blocks] and context_lens [seqs] int32; the scores' window
/// (0: none), soft-cap (0: none) and sinks (float32 [heads] or None).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, context_lens, out, scale, window, softcap, sinks, stream))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_paged_decode(
    q: TensorArg,
    k_cache: TensorArg,
    v_cache: TensorArg,
    block_tables: TensorArg,
    context_lens: TensorArg,
    out: TensorArg,
    scale: f32,
    window: usize,
    softcap: f32,
    sinks: Option<TensorArg>,
    stream: u64,
) -> PyResult<()> {
    let (dev, dt) = (q.device().to_string(), q.dtype().to_string());
    let [seqs, heads, head] = q.shape()[..] else {
        return Err(PyValueError::new_err(format!("q: has shape {:?}, expected [seqs, heads, head]", q.shape())));
    };
    let [num_blocks, block_size, kv_heads, _] = k_cache.shape()[..] else {
        return Err(PyValueError::new_err(format!("k_cache: has shape {:?}, expected [blocks, block_size, kv_heads, head]", k_cache.shape())));
    };
    let max_blocks = block_tables.shape().get(1).copied().unwrap_or(0);
    let shape = DecodeShape { seqs, paged: Layout { heads, kv_heads, head_size: head, num_blocks, block_size, max_blocks } };
    expect(&q, "q", &dev, None, &[Some(seqs), Some(heads), Some(head)])?;
    let cache = [Some(num_blocks), Some(block_size), Some(kv_heads), Some(head)];
    let k = expect(&k_cache, "k_cache", &dev, Some(&dt), &cache)?;
    let v = expect(&v_cache, "v_cache", &dev, Some(&dt), &cache)?;
    let tables = expect(&block_tables, "block_tables", &dev, Some("torch.int32"), &[Some(seqs), None])?;
    let lens = expect(&context_lens, "context_lens", &dev, Some("torch.int32"), &[Some(seqs)])?;
    let o = expect(&out, "out", &dev, Some(&dt), &[Some(seqs), Some(heads), Some(head)])?;
    let sinks = sinks.map(|t| expect(&t, "sinks", &dev, Some("torch.float32"), &[Some(heads)])).transpose()?;
    let _scores = DecodeScores { scale, window, softcap, sinks };
    let _dtype = dtype_of(&q)?;
    shape.check().map_err(PyValueError::new_err)?;
    _scores.check().map_err(PyValueError::new_err)?;
    #[cfg(feature = "cuda")]
    return launched(crate::cuda::launchers::paged_decode(&shape, _dtype, q.ptr(), k, v, tables, lens, o, &_scores, stream));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (k, v, tables, lens, o, stream);
        launched(Err(NO_CUDA.into()))
    }
}

/// New K/V [tokens, kv_heads, head] into the caches at slots (int64 [tokens]).
#[pyfunction]
pub fn cuda_write_kv(k: TensorArg, v: TensorArg, k_cache: TensorArg, v_cache: TensorArg, slots: TensorArg, stream: u64) -> PyResult<()> {
    let (dev, dt) = (k_cache.device().to_string(), k_cache.dtype().to_string());
    let [_, _, kv_heads, head] = k_cache.shape()[..] else {
        return Err(PyValueError::new_err(format!("k_cache: has shape {:?}, expected [blocks, block_size, kv_heads, head]", k_cache.shape())));
    };
    let tokens = k.shape().first().copied().unwrap_or(0);
    let cache: Vec<Option<usize>> = k_cache.shape().iter().map(|&d| Some(d)).collect();
    let kc = expect(&k_cache, "k_cache", &dev, None, &cache)?;
    let vc = expect(&v_cache, "v_cache", &dev, Some(&dt), &cache)?;
    let row = [Some(tokens), Some(kv_heads), Some(head)];
    let kp = expect(&k, "k", &dev, Some(&dt), &row)?;
    let vp = expect(&v, "v", &dev, Some(&dt), &row)?;
    let sp = expect(&slots, "slots", &dev, Some("torch.int64"), &[Some(tokens)])?;
    let _dtype = dtype_of(&k_cache)?;
    #[cfg(feature = "cuda")]
    return launched(crate::cuda::launchers::write_kv(_dtype, tokens, kv_heads * head, kp, vp, kc, vc, sp, stream));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (kp, vp, kc, vc, sp, stream);
        launched(Err(NO_CUDA.into()))
    }
}

/// The host-side checks of a sampling call, before its per-row values are
/// copied to the device: sizes agree and every row's knobs are valid.
#[pyfunction]
#[pyo3(signature = (vocab, words, temperature, top_k, top_p, min_p))]
pub fn check_sample_params(
    vocab: usize,
    words: Option<usize>,
    temperature: PyReadonlyArray1<'_, f32>,
    top_k: PyReadonlyArray1<'_, i32>,
    top_p: PyReadonlyArray1<'_, f32>,
    min_p: PyReadonlyArray1<'_, f32>,
) -> PyResult<()> {
    let params = row_params(&temperature, &top_k, &top_p, &min_p, None, None)?;
    reference::check_sample(params.len(), vocab, words, &params).map_err(PyValueError::new_err)
}

fn row_params(
    temperature: &PyReadonlyArray1<'_, f32>,
    top_k: &PyReadonlyArray1<'_, i32>,
    top_p: &PyReadonlyArray1<'_, f32>,
    min_p: &PyReadonlyArray1<'_, f32>,
    seeds: Option<&PyReadonlyArray1<'_, u64>>,
    steps: Option<&PyReadonlyArray1<'_, u64>>,
) -> PyResult<Vec<RowParams>> {
    let t = temperature.as_array();
    let rows = t.len();
    let n = |len: usize, name: &str| {
        if len == rows { Ok(()) } else { Err(PyValueError::new_err(format!("{name} has {len} rows, temperature {rows}"))) }
    };
    n(top_k.len(), "top_k")?;
    n(top_p.len(), "top_p")?;
    n(min_p.len(), "min_p")?;
    if let Some(s) = seeds {
        n(s.len(), "seeds")?;
    }
    if let Some(s) = steps {
        n(s.len(), "steps")?;
    }
    let (k, p, m) = (top_k.as_array(), top_p.as_array(), min_p.as_array());
    Ok((0..rows)
        .map(|r| RowParams {
            temperature: t[r],
            top_k: k[r],
            top_p: p[r],
            min_p: m[r],
            seed: seeds.map_or(0, |s| s.as_array()[r]),
            step: steps.map_or(0, |s| s.as_array()[r]),
        })
        .collect())
}

/// Mask-fused sampling on the GPU: logits [rows, vocab] float32, mask
/// [rows, words] int32 or None, per-row temperature/top_p/min_p float32,
/// top_k int32, seeds and steps int64 (read as uint64); writes tokens
/// (int64 [rows]) and logprobs (float32 [rows]).
#[pyfunction]
#[pyo3(signature = (logits, mask, temperature, top_k, top_p, min_p, seeds, steps, tokens, logprobs, stream))]
#[allow(clippy::too_many_arguments)]
pub fn cuda_masked_sample(
    logits: TensorArg,
    mask: Option<TensorArg>,
    temperature: TensorArg,
    top_k: TensorArg,
    top_p: TensorArg,
    min_p: TensorArg,
    seeds: TensorArg,
    steps: TensorArg,
    tokens: TensorArg,
    logprobs: TensorArg,
    stream: u64,
) -> PyResult<()> {
    let (dev, rows, vocab, l) = logits_arg(&logits)?;
    let (m, words) = match &mask {
        Some(t) => {
            let words = t.shape().get(1).copied().unwrap_or(0);
            if words < vocab.div_ceil(32) {
                return Err(PyValueError::new_err(format!("mask: {words} words per row; {vocab} tokens need {}", vocab.div_ceil(32))));
            }
            (expect(t, "mask", &dev, Some("torch.int32"), &[Some(rows), Some(words)])?, words)
        }
        None => (0, 0),
    };
    let row = [Some(rows)];
    let _p = SamplePointers {
        logits: l,
        mask: m,
        temperature: expect(&temperature, "temperature", &dev, Some("torch.float32"), &row)?,
        top_k: expect(&top_k, "top_k", &dev, Some("torch.int32"), &row)?,
        top_p: expect(&top_p, "top_p", &dev, Some("torch.float32"), &row)?,
        min_p: expect(&min_p, "min_p", &dev, Some("torch.float32"), &row)?,
        seeds: expect(&seeds, "seeds", &dev, Some("torch.int64"), &row)?,
        steps: expect(&steps, "steps", &dev, Some("torch.int64"), &row)?,
        tokens: expect(&tokens, "tokens", &dev, Some("torch.int64"), &row)?,
        logprobs: expect(&logprobs, "logprobs", &dev, Some("torch.float32"), &row)?,
    };
    #[cfg(feature = "cuda")]
    return launched(crate::cuda::launchers::masked_sample(rows, vocab, words, _p, stream));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (words, stream);
        launched(Err(NO_CUDA.into()))
    }
}

/// Penalties, logit bias and bans in place on logits [rows, vocab]: one
/// entry per distinct (row, token) (rows, tokens, seen, counts int32; bias
/// float32), per-row repetition/frequency/presence float32.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn cuda_adjust_logits(
    logits: TensorArg,
    rows: TensorArg,
    tokens: TensorArg,
    seen: TensorArg,
    counts: TensorArg,
    bias: TensorArg,
    repetition: TensorArg,
    frequency: TensorArg,
    presence: TensorArg,
    stream: u64,
) -> PyResult<()> {
    let (dev, nrows, vocab, l) = logits_arg(&logits)?;
    let entries = rows.shape().first().copied().unwrap_or(0);
    let e = [Some(entries)];
    let r = expect(&rows, "rows", &dev, Some("torch.int32"), &e)?;
    let t = expect(&tokens, "tokens", &dev, Some("torch.int32"), &e)?;
    let s = expect(&seen, "seen", &dev, Some("torch.int32"), &e)?;
    let c = expect(&counts, "counts", &dev, Some("torch.int32"), &e)?;
    let b = expect(&bias, "bias", &dev, Some("torch.float32"), &e)?;
    let per_row = [Some(nrows)];
    let penalties = [
        expect(&repetition, "repetition", &dev, Some("torch.float32"), &per_row)?,
        expect(&frequency, "frequency", &dev, Some("torch.float32"), &per_row)?,
        expect(&presence, "presence", &dev, Some("torch.float32"), &per_row)?,
    ];
    #[cfg(feature = "cuda")]
    return launched(crate::cuda::launchers::adjust_logits(l, vocab, entries, r, t, s, c, b, penalties, stream));
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (l, vocab, r, t, s, c, b, penalties, stream);
        launched(Err(NO_CUDA.into()))
    }
}

fn contiguous<'a, T, E>(r: Result<&'a [T], E>, name: &str) -> PyResult<&'a [T]> {
    r.map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))
}

/// The decode kernel's algorithm on the CPU (float32 arrays; see
/// `cuda::reference::paged_decode`).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, context_lens, scale, window = 0, softcap = 0.0, sinks = None))]
#[allow(clippy::too_many_arguments)]
pub fn reference_paged_decode<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f32>,
    k_cache: PyReadonlyArray4<'py, f32>,
    v_cache: PyReadonlyArray4<'py, f32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    context_lens: PyReadonlyArray1<'py, i32>,
    scale: f32,
    window: usize,
    softcap: f32,
    sinks: Option<PyReadonlyArray1<'py, f32>>,
) -> PyResult<Bound<'py, PyArray3<f32>>> {
    let (qs, ks) = (q.shape().to_vec(), k_cache.shape().to_vec());
    let paged = Layout { heads: qs[1], kv_heads: ks[2], head_size: qs[2], num_blocks: ks[0], block_size: ks[1], max_blocks: block_tables.shape()[1] };
    let shape = DecodeShape { seqs: qs[0], paged };
    let out = reference::paged_decode(
        &shape,
        contiguous(q.as_slice(), "q")?,
        contiguous(k_cache.as_slice(), "k_cache")?,
        contiguous(v_cache.as_slice(), "v_cache")?,
        contiguous(block_tables.as_slice(), "block_tables")?,
        contiguous(context_lens.as_slice(), "context_lens")?,
        &DecodeScores { scale, window, softcap, sinks: sinks.as_ref().map(|s| contiguous(s.as_slice(), "sinks")).transpose()? },
    )
    .map_err(PyValueError::new_err)?;
    out.into_pyarray(py).reshape([qs[0], qs[1], qs[2]])
}

/// The sampling kernel's algorithm on the CPU: (tokens int64, logprobs float32).
#[pyfunction]
#[pyo3(signature = (logits, mask, temperature, top_k, top_p, min_p, seeds, steps))]
#[allow(clippy::too_many_arguments)]
pub fn reference_masked_sample<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    mask: Option<PyReadonlyArray2<'py, i32>>,
    temperature: PyReadonlyArray1<'py, f32>,
    top_k: PyReadonlyArray1<'py, i32>,
    top_p: PyReadonlyArray1<'py, f32>,
    min_p: PyReadonlyArray1<'py, f32>,
    seeds: PyReadonlyArray1<'py, u64>,
    steps: PyReadonlyArray1<'py, u64>,
) -> PyResult<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f32>>)> {
    let params = row_params(&temperature, &top_k, &top_p, &min_p, Some(&seeds), Some(&steps))?;
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    reference::check_sample(rows, vocab, mask.as_ref().map(|m| m.shape()[1]), &params).map_err(PyValueError::new_err)?;
    if mask.as_ref().is_some_and(|m| m.shape()[0] != rows) {
        return Err(PyValueError::new_err("mask must have a row per row of logits"));
    }
    let x = contiguous(logits.as_slice(), "logits")?;
    let words = mask.as_ref().map(|m| m.as_slice().map(|s| (s, m.shape()[1]))).transpose().map_err(|_| PyValueError::new_err("mask must be C-contiguous"))?;
    let drawn: Vec<(i64, f32)> = py.detach(|| {
        (0..rows)
            .map(|r| {
                let mask_row = words.map(|(w, n)| &w[r * n..(r + 1) * n]);
                reference::masked_sample(&x[r * vocab..(r + 1) * vocab], mask_row, &params[r])
            })
            .collect()
    });
    let (tokens, logprobs): (Vec<i64>, Vec<f32>) = drawn.into_iter().unzip();
    Ok((tokens.into_pyarray(py), logprobs.into_pyarray(py)))
}

/// The adjust kernel's algorithm on the CPU, in place on logits [rows,
/// vocab] float32 (the arguments of `cuda_adjust_logits`, as numpy arrays).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn reference_adjust_logits(
    mut logits: numpy::PyReadwriteArray2<'_, f32>,
    rows: Vec<i32>,
    tokens: Vec<i32>,
    seen: Vec<i32>,
    counts: Vec<i32>,
    bias: Vec<f32>,
    repetition: Vec<f32>,
    frequency: Vec<f32>,
    presence: Vec<f32>,
) -> PyResult<()> {
    let vocab = logits.shape()[1];
    let a = Adjustments { rows, tokens, seen, counts, bias, repetition, frequency, presence };
    let x = logits.as_slice_mut().map_err(|_| PyValueError::new_err("logits must be C-contiguous"))?;
    reference::adjust_logits(x, vocab, &a).map_err(PyValueError::new_err)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_kernel_files, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_paged_decode, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(check_sample_params, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_masked_sample, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_adjust_logits, m)?)?;
    m.add_function(wrap_pyfunction!(reference_paged_decode, m)?)?;
    m.add_function(wrap_pyfunction!(reference_masked_sample, m)?)?;
    m.add_function(wrap_pyfunction!(reference_adjust_logits, m)?)?;
    Ok(())
}
