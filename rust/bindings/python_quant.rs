//! PyO3 bindings for the quantized CPU matmul (`cpu/quant.rs`). Translation only.

use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use std::sync::Arc;

use crate::cpu::packed;
use crate::cpu::quant::{self, QuantMatrix};

/// A weight matrix [rows, cols] in a ggml block format, multiplied by ggml's CPU kernels.
#[pyclass(name = "QuantMatrix", module = "guided._native", frozen)]
pub struct PyQuantMatrix {
    /// shared with the CPU decoder that multiplies by it (`python_native_step.rs`)
    pub(crate) inner: Arc<QuantMatrix>,
}

#[pymethods]
impl PyQuantMatrix {
    /// `data`: the GGUF tensor's bytes as stored (rows contiguous); repacked, or copied where the
    /// format has no packing.
    #[new]
    fn new(py: Python<'_>, ggml_type: u32, rows: usize, cols: usize, data: PyReadonlyArray1<'_, u8>) -> PyResult<Self> {
        let bytes = data.as_slice().map_err(|_| PyValueError::new_err("data must be a contiguous uint8 array"))?;
        py.detach(|| QuantMatrix::new(ggml_type, rows, cols, bytes))
            .map(|inner| PyQuantMatrix { inner: Arc::new(inner) })
            .map_err(PyValueError::new_err)
    }

    /// A float32 [rows, cols] matrix in format `ggml_type`, by ggml's reference quantizer.
    #[staticmethod]
    fn quantize(py: Python<'_>, ggml_type: u32, dense: PyReadonlyArray2<'_, f32>) -> PyResult<Self> {
        let (rows, cols) = (dense.shape()[0], dense.shape()[1]);
        let values = dense.as_slice().map_err(|_| PyValueError::new_err("dense must be C-contiguous"))?;
        py.detach(|| QuantMatrix::quantize(ggml_type, rows, cols, values))
            .map(|inner| PyQuantMatrix { inner: Arc::new(inner) })
            .map_err(PyValueError::new_err)
    }

    /// Whether the multi-row kernels run it (its format has a packing); else ggml's one-row dot products.
    #[getter]
    fn packed(&self) -> bool {
        self.inner.packed().is_some()
    }

    #[getter]
    fn rows(&self) -> usize {
        self.inner.rows
    }

    #[getter]
    fn cols(&self) -> usize {
        self.inner.cols
    }

    #[getter]
    fn format(&self) -> &'static str {
        self.inner.format_name()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.nbytes()
    }

    /// out[b, r] = Σ_c x[b, c] · W[r, c]; `x` [batch, cols] and `out` [batch, rows], float32, C-contiguous.
    /// `precise`: a second pass over the 8-bit activations' rounding error (about 16-bit activations).
    #[pyo3(signature = (x, out, precise = false))]
    fn matmul(&self, py: Python<'_>, x: PyReadonlyArray2<'_, f32>, mut out: PyReadwriteArray2<'_, f32>, precise: bool) -> PyResult<()> {
        let (xs, os) = (x.shape().to_vec(), out.shape().to_vec());
        if xs[1] != self.inner.cols || os[1] != self.inner.rows || xs[0] != os[0] {
            return Err(PyValueError::new_err(format!(
                "matmul of x {xs:?} with a [{}, {}] matrix into out {os:?}",
                self.inner.rows, self.inner.cols
            )));
        }
        let x = x.as_slice().map_err(|_| PyValueError::new_err("x must be C-contiguous"))?;
        let out = out.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
        py.detach(|| self.inner.matmul(x, out, precise));
        Ok(())
    }

    /// The rows `ids` dequantized, float32 [len(ids), cols] (an embedding lookup); an id past the
    /// last row is a ValueError naming it.
    fn dequantize_rows<'py>(&self, py: Python<'py>, ids: PyReadonlyArray1<'py, i64>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let ids = ids.as_slice().map_err(|_| PyValueError::new_err("ids must be a contiguous int64 array"))?;
        let (rows, cols) = (self.inner.rows, self.inner.cols);
        if let Some(bad) = ids.iter().find(|&&id| id < 0 || id as usize >= rows) {
            return Err(PyValueError::new_err(format!("row {bad} of a matrix of {rows} rows")));
        }
        let mut out = vec![0f32; ids.len() * cols];
        py.detach(|| {
            for (row, &id) in out.chunks_exact_mut(cols.max(1)).zip(ids) {
                self.inner.dequantize_row(id as usize, row);
            }
        });
        Ok(out.into_pyarray(py).reshape([ids.len(), cols]).expect("ids × cols"))
    }

    /// The dense float32 matrix [rows, cols], by ggml's dequantization: into `out` when given
    /// (a float32 C-contiguous array of rows × cols elements, reused by callers), else a new array.
    #[pyo3(signature = (out = None))]
    fn dequantize<'py>(&self, py: Python<'py>, out: Option<Bound<'py, PyArray2<f32>>>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let shape = [self.inner.rows, self.inner.cols];
        let Some(out) = out else {
            let mut dense = vec![0f32; shape[0] * shape[1]];
            py.detach(|| self.inner.dequantize(&mut dense));
            return Ok(dense.into_pyarray(py).reshape(shape).expect("rows × cols"));
        };
        if out.shape() != shape {
            return Err(PyValueError::new_err(format!("dequantize into {:?}, not {shape:?}", out.shape())));
        }
        {
            let mut rw = out.try_readwrite().map_err(|e| PyValueError::new_err(e.to_string()))?;
            let dense = rw.as_slice_mut().map_err(|_| PyValueError::new_err("out must be C-contiguous"))?;
            py.detach(|| self.inner.dequantize(dense));
        }
        Ok(out)
    }

    fn __repr__(&self) -> String {
        format!("QuantMatrix({}, [{}, {}])", self.inner.format_name(), self.inner.rows, self.inner.cols)
    }
}

/// A file of packed matrices (a load-cache entry: model/pack_cache.py), mapped read-only.
#[pyclass(name = "PackedFile", module = "guided._native", frozen)]
pub struct PyPackedFile {
    map: Arc<memmap2::Mmap>,
}

#[pymethods]
impl PyPackedFile {
    #[new]
    fn new(path: std::path::PathBuf) -> PyResult<Self> {
        packed::map_file(&path)
            .map(|map| PyPackedFile { map })
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display())))
    }

    #[getter]
    fn size(&self) -> usize {
        self.map.len()
    }

    /// Write the packed records of `matrices` to a new file at `path`, each from a multiple of
    /// 64 bytes; (offset, nbytes) of each, for `matrix`. ValueError names a matrix without a
    /// packing; OSError, a write that failed.
    #[staticmethod]
    fn write(py: Python<'_>, path: std::path::PathBuf, matrices: Vec<PyRef<'_, PyQuantMatrix>>) -> PyResult<Vec<(usize, usize)>> {
        let held: Vec<Arc<QuantMatrix>> = matrices.iter().map(|m| m.inner.clone()).collect();
        if let Some(i) = held.iter().position(|m| m.packed().is_none()) {
            return Err(PyValueError::new_err(format!("matrix {i} ({}) has no packing", held[i].format_name())));
        }
        py.detach(|| packed::write_records(&path, held.iter().map(|m| m.packed().expect("checked").bytes())))
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(format!("{}: {e}", path.display())))
    }

    /// The [rows, cols] matrix of format `ggml_type` whose packed records are the file's `nbytes`
    /// from `offset` (as `write` put them there), read in place; ValueError where they
    /// are not such a packing or not in the file.
    fn matrix(&self, py: Python<'_>, ggml_type: u32, rows: usize, cols: usize, offset: usize, nbytes: usize) -> PyResult<PyQuantMatrix> {
        let records = packed::Records::mapped(&self.map, offset, nbytes).map_err(PyValueError::new_err)?;
        py.detach(|| QuantMatrix::from_packed(ggml_type, rows, cols, records))
            .map(|inner| PyQuantMatrix { inner: Arc::new(inner) })
            .map_err(PyValueError::new_err)
    }
}

/// A float32 [rows, cols] matrix as ggml rows of format `ggml_type` (a GGUF tensor's bytes), by ggml's
/// reference quantizer.
#[pyfunction]
pub fn ggml_quantize<'py>(py: Python<'py>, ggml_type: u32, dense: PyReadonlyArray2<'py, f32>) -> PyResult<Bound<'py, numpy::PyArray1<u8>>> {
    let (rows, cols) = (dense.shape()[0], dense.shape()[1]);
    let values = dense.as_slice().map_err(|_| PyValueError::new_err("dense must be C-contiguous"))?;
    let bytes = py.detach(|| quant::quantize_rows(ggml_type, rows, cols, values)).map_err(PyValueError::new_err)?;
    Ok(bytes.into_pyarray(py))
}

/// The ISA level of ggml's kernels picked for this CPU ("avx2", "avx512"), or None where there is none.
#[pyfunction]
pub fn quant_kernels() -> Option<&'static str> {
    quant::kernels().map(|k| k.level)
}

/// The ISA the multi-row packed kernels run with here: "avx512_vnni", "avx2" or "scalar".
#[pyfunction]
pub fn packed_kernels() -> &'static str {
    crate::cpu::packed::isa().name()
}

/// The ggml type ids that have a quantized CPU kernel, by name.
#[pyfunction]
pub fn quant_formats() -> Vec<(&'static str, u32)> {
    quant::FORMATS.iter().map(|f| (f.1, f.0)).collect()
}
