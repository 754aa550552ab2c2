//! PyO3 bindings for the CPU attention over the paged cache (`cpu/cpu_attention.rs`). Translation only.

use numpy::{PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadonlyArray4, PyReadwriteArray3, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpu::cpu_attention::{self, KvElem, Layout, Rows, Scores};

fn slice<'a, T, E>(r: Result<&'a [T], E>, name: &str) -> PyResult<&'a [T]> {
    r.map_err(|_| PyValueError::new_err(format!("{name} must be C-contiguous")))
}

/// out [rows, heads, head_size] = each query row's attention over positions
/// 0..=pos[r] of sequence seq[r] (windowed, soft-capped, with sinks where
/// given). `q` float32; the caches [blocks, block_size, kv_heads, head_size]
/// float32, or bfloat16 passed as uint16 bits. `linger`: the kernel threads
/// spin after the call, for the next native kernel (false: they sleep, for torch's threads).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_tables, seq, pos, out, scale, window=None, softcap=None, sinks=None, linger=true))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_paged_attention<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f32>,
    k_cache: Bound<'py, PyAny>,
    v_cache: Bound<'py, PyAny>,
    block_tables: PyReadonlyArray2<'py, i32>,
    seq: PyReadonlyArray1<'py, i32>,
    pos: PyReadonlyArray1<'py, i32>,
    mut out: PyReadwriteArray3<'py, f32>,
    scale: f32,
    window: Option<usize>,
    softcap: Option<f32>,
    sinks: Option<PyReadonlyArray1<'py, f32>>,
    linger: bool,
) -> PyResult<()> {
    let scores = Scores { scale, window, softcap };
    let (qs, tables) = (q.shape().to_vec(), block_tables.shape().to_vec());
    let rows = Rows {
        tables: slice(block_tables.as_slice(), "block_tables")?,
        seq: slice(seq.as_slice(), "seq")?,
        pos: slice(pos.as_slice(), "pos")?,
    };
    let q = slice(q.as_slice(), "q")?;
    let sinks = match &sinks {
        Some(s) => Some(slice(s.as_slice(), "sinks")?),
        None => None,
    };
    let out = out.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
    #[allow(clippy::too_many_arguments)]
    fn run<T: KvElem + numpy::Element>(
        py: Python<'_>, k: &Bound<'_, PyAny>, v: &Bound<'_, PyAny>, qs: &[usize], tables: &[usize],
        q: &[f32], rows: &Rows, scores: Scores, sinks: Option<&[f32]>, out: &mut [f32], linger: bool,
    ) -> PyResult<()> {
        let (k, v) = (k.extract::<PyReadonlyArray4<T>>()?, v.extract::<PyReadonlyArray4<T>>()?);
        let ks = k.shape();
        let layout = Layout {
            heads: qs[1], kv_heads: ks[2], head_size: qs[2], num_blocks: ks[0], block_size: ks[1], max_blocks: tables[1],
        };
        if ks[3] != qs[2] || v.shape() != ks {
            return Err(PyValueError::new_err(format!("caches {ks:?} and {:?} do not fit q {qs:?}", v.shape())));
        }
        let (k, v) = (slice(k.as_slice(), "k_cache")?, slice(v.as_slice(), "v_cache")?);
        py.detach(|| cpu_attention::paged_attention(&layout, q, k, v, rows, scores, sinks, out, linger)).map_err(PyValueError::new_err)
    }
    if k_cache.extract::<PyReadonlyArray4<f32>>().is_ok() {
        run::<f32>(py, &k_cache, &v_cache, &qs, &tables, q, &rows, scores, sinks, out, linger)
    } else if k_cache.extract::<PyReadonlyArray4<u16>>().is_ok() {
        run::<u16>(py, &k_cache, &v_cache, &qs, &tables, q, &rows, scores, sinks, out, linger)
    } else {
        Err(PyValueError::new_err("k_cache must be a 4-D float32 array, or bfloat16 as uint16"))
    }
}
