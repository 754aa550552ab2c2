//! PyO3 bindings: argument and result translation only.

use std::collections::HashMap;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::engine::block_manager::CacheEvent;
use crate::cuda::reference::RowParams;
use crate::cuda::device_sampling::DeviceRows;
use crate::bindings::python_grammar::PyGrammar;
use crate::sampling::cpu_sampler::Sampled;
use crate::bindings::python_plan::PyStepPlan;
use crate::engine::scheduler::{Error, Scheduler, SchedulerConfig, SpecConfig, StepOutput};
use crate::engine::masks::MaskPolicy;
use crate::engine::speculative::Drafter;
use crate::engine::sequence::{LogitBias, RequestParams, Steering};

/// Per row: None, or (the token's logprob, [(token, logprob)] most likely first).
type RowLogprobs = Option<(f32, Vec<(u32, f32)>)>;
/// (tokens, logprobs, per-row logprobs for rows that asked for them)
type Draws<'py> = (Bound<'py, PyArray1<i64>>, Bound<'py, PyArray1<f32>>, Vec<RowLogprobs>);

fn to_py(e: Error) -> PyErr {
    match e {
        Error::Invalid(m) => PyValueError::new_err(m),
        Error::State(m) => PyRuntimeError::new_err(m),
    }
}

#[pyclass(name = "Scheduler", module = "guided._native")]
struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                        eos_token_ids, enable_prefix_caching = true, speculative = false,
                        num_speculative_tokens = 0, drafter = "lookup", masks = "overlap"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: usize,
        block_size: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        eos_token_ids: Vec<i64>,
        enable_prefix_caching: bool,
        speculative: bool,
        num_speculative_tokens: usize,
        drafter: &str,
        masks: &str,
    ) -> PyResult<Self> {
        let drafter = Drafter::parse(drafter).map_err(PyValueError::new_err)?;
        let masks = MaskPolicy::parse(masks).map_err(PyValueError::new_err)?;
        let cfg = SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            eos_token_ids,
            enable_prefix_caching,
            speculation: SpecConfig { by_default: speculative, max_tokens: num_speculative_tokens, drafter },
            masks,
        };
        Ok(PyScheduler { inner: Scheduler::new(cfg).map_err(to_py)? })
    }

    #[pyo3(signature = (seq_id, prompt_token_ids, params, grammar = None, close_on_length = false, reasoning_end = None, closed_as_length = false))]
    fn add_request(
        &mut self,
        seq_id: i128,
        prompt_token_ids: Vec<i64>,
        params: RequestParams,
        grammar: Option<PyRef<'_, PyGrammar>>,
        close_on_length: bool,
        reasoning_end: Option<(u32, usize)>,
        closed_as_length: bool,
    ) -> PyResult<Vec<u32>> {
        let grammar = grammar.as_ref().map(|g| &g.inner);
        let steering = Steering { close_on_length, closed_as_length, reasoning_end };
        self.inner.add_constrained(seq_id, &prompt_token_ids, &params, grammar, steering).map_err(to_py)
    }

    // Calls that may wait for the mask thread release the GIL: the thread
    // may need it (a Python tokenizer).

    fn schedule(&mut self, py: Python<'_>) -> Option<PyStepPlan> {
        let inner = &mut self.inner;
        py.detach(|| inner.schedule()).map(|plan| PyStepPlan::new(py, plan))
    }

    /// Whether the plan in flight carries drafts (then only `sample()`, on
    /// host logits, draws it).
    fn speculating(&self) -> bool {
        self.inner.speculating()
    }

    /// What a forward pass costs, fixed and per token fed (speculative
    /// drafts are sized by it).
    fn set_step_cost(&mut self, fixed: f32, per_token: f32) {
        self.inner.set_step_cost(fixed, per_token)
    }

    /// Computes the masks here where the forward pass runs on the CPU (`MaskPolicy::OnDemand`).
    fn start_masks(&mut self, py: Python<'_>) -> PyResult<()> {
        let inner = &mut self.inner;
        py.detach(|| inner.start_masks()).map_err(to_py)
    }

    #[pyo3(signature = (logits, allowed = None))]
    fn sample<'py>(
        &mut self,
        py: Python<'py>,
        logits: PyReadonlyArray2<'py, f32>,
        allowed: Option<PyReadonlyArray2<'py, i32>>,
    ) -> PyResult<Draws<'py>> {
        let [rows, vocab] = [logits.shape()[0], logits.shape()[1]];
        let logits = logits.as_array();
        let logits = logits.as_standard_layout();
        let mask_view = allowed.as_ref().map(|m| m.as_array());
        let mask = mask_view.as_ref().map(|m| m.as_standard_layout());
        let flat = logits.as_slice().expect("standard layout");
        let mask = mask.as_ref().map(|m| (m.as_slice().expect("standard layout"), m.ncols()));
        let inner = &mut self.inner;
        let out = py.detach(|| inner.sample(flat, rows, vocab, mask)).map_err(to_py)?;
        Ok(draws(py, out))
    }

    fn device_rows(&mut self, py: Python<'_>, vocab: usize) -> PyResult<PyDeviceRows> {
        let inner = &mut self.inner;
        let rows = py.detach(|| inner.device_rows(vocab)).map_err(to_py)?;
        Ok(PyDeviceRows::new(py, rows))
    }

    fn sample_host<'py>(
        &mut self,
        py: Python<'py>,
        logits: PyReadonlyArray2<'py, f32>,
        rows: Vec<usize>,
    ) -> PyResult<Draws<'py>> {
        let vocab = logits.shape()[1];
        let logits = logits.as_array();
        let logits = logits.as_standard_layout();
        let flat = logits.as_slice().expect("standard layout");
        let inner = &mut self.inner;
        let out = py.detach(|| inner.sample_host(flat, &rows, vocab)).map_err(to_py)?;
        Ok(draws(py, out))
    }

    fn update(&mut self, py: Python<'_>, sampled: PyReadonlyArray1<'_, i64>) -> PyResult<Vec<PyStepOutput>> {
        let sampled = sampled.as_array().to_vec();
        let inner = &mut self.inner;
        let out = py.detach(|| inner.update(&sampled)).map_err(to_py)?;
        Ok(out.into_iter().map(PyStepOutput::from).collect())
    }

    fn abort(&mut self, seq_id: u64) -> bool {
        self.inner.abort(seq_id)
    }

    /// A prefix-cache hit for `seq_id` only of exactly its first `tokens` tokens, or none.
    fn limit_prefix(&mut self, seq_id: u64, tokens: usize) -> bool {
        self.inner.limit_prefix(seq_id, tokens)
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }

    fn num_cached_tokens(&self, seq_id: u64) -> PyResult<usize> {
        self.inner
            .num_cached_tokens(seq_id)
            .ok_or_else(|| PyValueError::new_err(format!("unknown or finished seq_id {seq_id}")))
    }

    fn stats(&self) -> HashMap<&'static str, usize> {
        self.inner.stats().into_iter().collect()
    }

    fn record_cache_events(&mut self) {
        self.inner.record_cache_events()
    }

    fn take_cache_events(&mut self) -> Vec<(bool, u64, Option<u64>, Vec<u32>)> {
        self.inner
            .take_cache_events()
            .into_iter()
            .map(|e| match e {
                CacheEvent::Stored { hash, parent, tokens } => (true, hash, parent, tokens),
                CacheEvent::Removed { hash } => (false, hash, None, Vec::new()),
            })
            .collect()
    }
}

/// `logit_bias` as SamplingParams holds it (`{token: bias}` or None).
impl<'py> FromPyObject<'_, 'py> for LogitBias {
    type Error = PyErr;

    fn extract(value: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if value.is_none() {
            return Ok(LogitBias::default());
        }
        let bias: HashMap<i64, f64> = value.extract()?;
        let mut pairs: Vec<(i64, f64)> = bias.into_iter().collect();
        pairs.sort_by_key(|p| p.0);
        Ok(LogitBias(pairs))
    }
}

/// What `update()` did for one sampling row.
#[pyclass(name = "StepOutput", module = "guided._native", frozen, get_all)]
struct PyStepOutput {
    seq_id: u64,
    token: i64,
    finish_reason: Option<&'static str>,
    num_cached_tokens: usize,
    forced: Vec<u32>,
    more: Vec<u32>,
    more_forced: usize,
    error: Option<String>,
    closed: bool,
    closing_us: u64,
}

impl From<StepOutput> for PyStepOutput {
    fn from(o: StepOutput) -> Self {
        PyStepOutput {
            seq_id: o.seq_id,
            token: o.token,
            finish_reason: o.finish_reason.map(|r| r.as_str()),
            num_cached_tokens: o.num_cached_tokens,
            forced: o.forced,
            more: o.more,
            more_forced: o.more_forced,
            error: o.error,
            closed: o.closed,
            closing_us: o.closing_us,
        }
    }
}

#[pymethods]
impl PyStepOutput {
    fn __repr__(&self) -> String {
        format!(
            "StepOutput(seq_id={}, token={}, finish_reason={:?}, num_cached_tokens={}, forced={:?}, more={:?}, error={:?}, closed={})",
            self.seq_id, self.token, self.finish_reason, self.num_cached_tokens, self.forced, self.more, self.error, self.closed
        )
    }
}

fn draws(py: Python<'_>, out: Vec<Sampled>) -> Draws<'_> {
    let tokens: Vec<i64> = out.iter().map(|s| s.token).collect();
    let logprobs: Vec<f32> = out.iter().map(|s| s.logprob).collect();
    let tops = out.into_iter().map(|s| s.top.map(|t| (t.logprob, t.top))).collect();
    (tokens.into_pyarray(py), logprobs.into_pyarray(py), tops)
}

/// One step's sampling rows as the device sampler reads them
/// (rust/cuda/device_sampling.rs), as numpy arrays.
#[pyclass(name = "DeviceRows", module = "guided._native", frozen)]
struct PyDeviceRows {
    #[pyo3(get)]
    mask: Option<Py<PyArray2<i32>>>,
    #[pyo3(get)]
    temperature: Py<PyArray1<f32>>,
    #[pyo3(get)]
    top_k: Py<PyArray1<i32>>,
    #[pyo3(get)]
    top_p: Py<PyArray1<f32>>,
    #[pyo3(get)]
    min_p: Py<PyArray1<f32>>,
    #[pyo3(get)]
    seeds: Py<PyArray1<u64>>,
    #[pyo3(get)]
    steps: Py<PyArray1<u64>>,
    #[pyo3(get)]
    entry_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    entry_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    entry_seen: Py<PyArray1<i32>>,
    #[pyo3(get)]
    entry_counts: Py<PyArray1<i32>>,
    #[pyo3(get)]
    entry_bias: Py<PyArray1<f32>>,
    #[pyo3(get)]
    repetition: Py<PyArray1<f32>>,
    #[pyo3(get)]
    frequency: Py<PyArray1<f32>>,
    #[pyo3(get)]
    presence: Py<PyArray1<f32>>,
    #[pyo3(get)]
    host: Py<PyArray1<bool>>,
}

impl PyDeviceRows {
    fn new(py: Python<'_>, d: DeviceRows) -> Self {
        let rows = d.params.len();
        let mask = (d.words > 0).then(|| {
            numpy::ndarray::Array2::from_shape_vec((rows, d.words), d.mask).expect("mask is rows × words").into_pyarray(py).unbind()
        });
        let col = |f: fn(&RowParams) -> f32| d.params.iter().map(f).collect::<Vec<f32>>().into_pyarray(py).unbind();
        let a = d.adjust;
        PyDeviceRows {
            mask,
            temperature: col(|p| p.temperature),
            top_k: d.params.iter().map(|p| p.top_k).collect::<Vec<i32>>().into_pyarray(py).unbind(),
            top_p: col(|p| p.top_p),
            min_p: col(|p| p.min_p),
            seeds: d.params.iter().map(|p| p.seed).collect::<Vec<u64>>().into_pyarray(py).unbind(),
            steps: d.params.iter().map(|p| p.step).collect::<Vec<u64>>().into_pyarray(py).unbind(),
            entry_rows: a.rows.into_pyarray(py).unbind(),
            entry_tokens: a.tokens.into_pyarray(py).unbind(),
            entry_seen: a.seen.into_pyarray(py).unbind(),
            entry_counts: a.counts.into_pyarray(py).unbind(),
            entry_bias: a.bias.into_pyarray(py).unbind(),
            repetition: a.repetition.into_pyarray(py).unbind(),
            frequency: a.frequency.into_pyarray(py).unbind(),
            presence: a.presence.into_pyarray(py).unbind(),
            host: d.host.into_pyarray(py).unbind(),
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PyDeviceRows>()?;
    m.add_class::<PyStepOutput>()?;
    m.add_class::<crate::bindings::python_grammar::PyGrammarCompiler>()?;
    m.add_class::<crate::bindings::python_grammar::PyGrammar>()?;
    m.add_class::<crate::bindings::python_grammar::PyMatcher>()?;
    m.add_class::<crate::bindings::python_quant::PyQuantMatrix>()?;
    m.add_class::<crate::bindings::python_quant::PyPackedFile>()?;
    m.add_function(wrap_pyfunction!(crate::bindings::python_quant::quant_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(crate::bindings::python_quant::quant_formats, m)?)?;
    m.add_function(wrap_pyfunction!(crate::bindings::python_quant::ggml_quantize, m)?)?;
    m.add_function(wrap_pyfunction!(crate::bindings::python_quant::packed_kernels, m)?)?;
    m.add_class::<crate::bindings::python_native_step::PyCpuDecoder>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeSpec>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeLinear>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeMlp>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeMoe>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeAttention>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeShortConv>()?;
    m.add_class::<crate::bindings::python_native_step::PyNativeLayer>()?;
    m.add_function(wrap_pyfunction!(crate::bindings::python_cpu_attention::cpu_paged_attention, m)?)?;
    crate::bindings::python_cuda::register(m)?;
    Ok(())
}
