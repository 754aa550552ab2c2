//! PyO3 binding of a step's plan (`engine::scheduler::StepPlan`): the flat arrays
//! the model runner and the native CPU step read. Translation only.

use numpy::{IntoPyArray, PyArray1, PyArray2};
use pyo3::prelude::*;

use crate::engine::scheduler::StepPlan;

#[pyclass(name = "StepPlan", module = "guided._native", frozen)]
pub(crate) struct PyStepPlan {
    #[pyo3(get)]
    pub(crate) input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    pub(crate) context_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub(crate) seq_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) logits_indices: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) sample_seq_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    pub(crate) max_query_len: usize,
    #[pyo3(get)]
    pub(crate) max_context_len: usize,
    #[pyo3(get)]
    pub(crate) is_decode_only: bool,
    #[pyo3(get)]
    pub(crate) num_tokens: usize,
}

impl PyStepPlan {
    pub(crate) fn new(py: Python<'_>, p: StepPlan) -> Self {
        let rows = p.seq_ids.len();
        let tables = numpy::ndarray::Array2::from_shape_vec((rows, p.max_blocks), p.block_tables)
            .expect("block table is rows × max_blocks");
        PyStepPlan {
            input_ids: p.input_ids.into_pyarray(py).unbind(),
            positions: p.positions.into_pyarray(py).unbind(),
            slot_mapping: p.slot_mapping.into_pyarray(py).unbind(),
            block_tables: tables.into_pyarray(py).unbind(),
            context_lens: p.context_lens.into_pyarray(py).unbind(),
            query_start_loc: p.query_start_loc.into_pyarray(py).unbind(),
            seq_ids: p.seq_ids.into_pyarray(py).unbind(),
            logits_indices: p.logits_indices.into_pyarray(py).unbind(),
            sample_seq_ids: p.sample_seq_ids.into_pyarray(py).unbind(),
            max_query_len: p.max_query_len,
            max_context_len: p.max_context_len,
            is_decode_only: p.is_decode_only,
            num_tokens: p.num_tokens,
        }
    }
}

#[pymethods]
impl PyStepPlan {
    fn __repr__(&self) -> String {
        format!(
            "StepPlan(num_tokens={}, max_query_len={}, max_context_len={}, is_decode_only={})",
            self.num_tokens, self.max_query_len, self.max_context_len, self.is_decode_only
        )
    }
}
