//! PyO3 bindings for the CPU step (`cpu/native_step.rs`). Translation only:
//! the model comes in as typed records (`NativeSpec`, `NativeLinear`,
//! `NativeMlp`, `NativeMoe`, `NativeAttention`, `NativeShortConv`,
//! `NativeLayer`; built by `python/guided/model/native.py` from the loaded
//! model), each checked where it is built: keyword arguments only, so a
//! mistyped or missing key is Python's TypeError naming it, an unknown
//! feature string a ValueError naming the field and the values it takes, a
//! wrong array the argument's name. A record holds the core struct it
//! stands for; its weights are shared (Arc), not copied, into the decoder.

use std::sync::Arc;

use numpy::{IntoPyArray, PyArray2, PyArray4, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::cpu::cpu_attention::Scores;
use crate::cpu::native_step::{Activation, Attention, Borrowed, Cache, ConvMixer, Decoder, Embedding, Expert, Layer, Linear, Mixer, Mlp, Moe, NormKind, Norms, QkNorm, Routing, Scoring, Spec, Step, Weight};
use crate::cpu::gated_conv::ShortConv;
use crate::cpu::dense::DenseMatrix;
use crate::bindings::python_plan::PyStepPlan;
use crate::bindings::python_quant::PyQuantMatrix;

fn err(what: &str, e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("{what}: {e}"))
}

/// `value` of `field` among `choices` (its name, and what it means), or an error naming the ones there are.
fn pick<T: Copy>(field: &str, value: &str, choices: &[(&str, T)]) -> PyResult<T> {
    match choices.iter().find(|(n, _)| *n == value) {
        Some(&(_, v)) => Ok(v),
        None => {
            let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
            Err(err(field, format!("unknown '{value}' (one of {})", names.join(", "))))
        }
    }
}

const NORMS: &[(&str, Norms)] = &[("pre", Norms::Pre), ("post", Norms::Post), ("sandwich", Norms::Sandwich), ("parallel", Norms::Parallel)];
const NORM_KINDS: &[(&str, NormKind)] = &[("rms", NormKind::Rms), ("layer", NormKind::Layer)];
const QK_NORMS: &[(&str, QkNorm)] = &[("head", QkNorm::Head), ("full", QkNorm::Full)];
const SCORINGS: &[(&str, Scoring)] = &[("softmax", Scoring::Softmax), ("softmax_topk", Scoring::SoftmaxTopK), ("sigmoid", Scoring::Sigmoid)];

fn floats(a: Option<PyReadonlyArray1<'_, f32>>, what: &str) -> PyResult<Option<Vec<f32>>> {
    a.map(|a| a.to_vec().map_err(|e| err(what, e))).transpose()
}

/// One stacked part: a QuantMatrix (shared) or a 2-D float32 array (repacked once, then shared).
fn weight(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Weight> {
    if let Ok(m) = obj.cast::<PyQuantMatrix>() {
        return Ok(Weight::Quant(m.get().inner.clone()));
    }
    let a = obj.cast::<PyArray2<f32>>().map_err(|_| PyTypeError::new_err(format!("{what}: a QuantMatrix or a 2-D float32 array")))?;
    let ro = a.readonly();
    let (rows, cols) = (ro.shape()[0], ro.shape()[1]);
    let values = ro.as_slice().map_err(|_| err(what, "not C-contiguous"))?;
    DenseMatrix::new(rows, cols, values).map(|m| Weight::Dense(Arc::new(m))).map_err(|e| err(what, e))
}

/// The model's shape and its architecture's choices (architectures.py's row, the config's sizes).
#[pyclass(name = "NativeSpec", module = "guided._native", frozen)]
pub struct PyNativeSpec {
    inner: Spec,
}

#[pymethods]
impl PyNativeSpec {
    #[new]
    #[pyo3(signature = (*, hidden, heads, kv_heads, head_dim, rotary_dim, eps, norms, norm_kind, qk_norm, qk_norm_after_rope,
                        activation, swiglu_alpha, swiglu_limit, residual_multiplier, embedding_multiplier,
                        logit_multiplier, final_softcap))]
    #[allow(clippy::too_many_arguments)]
    fn new(hidden: usize, heads: usize, kv_heads: usize, head_dim: usize, rotary_dim: usize, eps: f32, norms: &str,
           norm_kind: &str, qk_norm: Option<&str>, qk_norm_after_rope: bool, activation: &str, swiglu_alpha: f32,
           swiglu_limit: f32, residual_multiplier: f32, embedding_multiplier: f32, logit_multiplier: f32,
           final_softcap: Option<f32>) -> PyResult<Self> {
        let oai = Activation::SwigluOai { alpha: swiglu_alpha, limit: swiglu_limit };
        let activations = [("silu", Activation::Silu), ("gelu_tanh", Activation::GeluTanh), ("swiglu_oai", oai)];
        Ok(PyNativeSpec {
            inner: Spec {
                hidden,
                heads,
                kv_heads,
                head_dim,
                rotary_dim,
                eps,
                norms: pick("norms", norms, NORMS)?,
                norm_kind: pick("norm_kind", norm_kind, NORM_KINDS)?,
                qk_norm: qk_norm.map(|q| pick("qk_norm", q, QK_NORMS)).transpose()?,
                qk_norm_after_rope,
                activation: pick("activation", activation, &activations)?,
                residual_multiplier,
                embedding_multiplier,
                logit_multiplier,
                final_softcap,
            },
        })
    }
}

/// A linear layer: its stacked parts (QuantMatrix or 2-D float32 array, by rows) and a bias.
#[pyclass(name = "NativeLinear", module = "guided._native", frozen)]
pub struct PyNativeLinear {
    inner: Linear,
}

#[pymethods]
impl PyNativeLinear {
    /// `precise`: quantized activations get a second pass over their rounding error (the output head).
    #[new]
    #[pyo3(signature = (*, parts, bias=None, precise=false))]
    fn new(parts: Vec<Bound<'_, PyAny>>, bias: Option<PyReadonlyArray1<'_, f32>>, precise: bool) -> PyResult<Self> {
        let parts = parts.iter().enumerate().map(|(i, p)| weight(p, &format!("parts[{i}]"))).collect::<PyResult<Vec<_>>>()?;
        let inner = Linear::new(parts, floats(bias, "bias")?, precise).map_err(|e| err("NativeLinear", e))?;
        Ok(PyNativeLinear { inner })
    }
}

/// A gated MLP (or one expert): gate|up stacked, then down.
#[pyclass(name = "NativeMlp", module = "guided._native", frozen)]
pub struct PyNativeMlp {
    inner: Expert,
}

#[pymethods]
impl PyNativeMlp {
    #[new]
    #[pyo3(signature = (*, gate_up, down))]
    fn new(gate_up: PyRef<'_, PyNativeLinear>, down: PyRef<'_, PyNativeLinear>) -> Self {
        PyNativeMlp { inner: Expert { gate_up: gate_up.inner.clone(), down: down.inner.clone() } }
    }
}

/// A mixture of experts: the router, how it routes (MoEConfig's fields), the experts.
#[pyclass(name = "NativeMoe", module = "guided._native", frozen)]
pub struct PyNativeMoe {
    inner: Moe,
}

#[pymethods]
impl PyNativeMoe {
    #[new]
    #[pyo3(signature = (*, router, scoring, top_k, norm_topk_prob, routed_scaling, groups, topk_groups, experts,
                        shared=None, selection_bias=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(router: PyRef<'_, PyNativeLinear>, scoring: &str, top_k: usize, norm_topk_prob: bool, routed_scaling: f32,
           groups: usize, topk_groups: usize, experts: Vec<PyRef<'_, PyNativeMlp>>, shared: Option<PyRef<'_, PyNativeMlp>>,
           selection_bias: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Self> {
        let routing = Routing {
            scoring: pick("scoring", scoring, SCORINGS)?,
            selection_bias: floats(selection_bias, "selection_bias")?,
            top_k,
            norm_topk_prob,
            routed_scaling,
            groups,
            topk_groups,
        };
        let experts = experts.iter().map(|e| e.inner.clone()).collect();
        Ok(PyNativeMoe { inner: Moe { router: router.inner.clone(), routing, experts, shared: shared.map(|s| s.inner.clone()) } })
    }
}

/// Attention as a layer's mixer: q|k|v stacked, the output projection, how scores are made.
#[pyclass(name = "NativeAttention", module = "guided._native", frozen)]
pub struct PyNativeAttention {
    inner: Attention,
}

#[pymethods]
impl PyNativeAttention {
    /// `rope`: which of the decoder's rotary tables the layer uses (None: it does not rotate);
    /// `sinks`: a logit per head that joins its softmax (gpt-oss).
    #[new]
    #[pyo3(signature = (*, qkv, o, scale, window=None, softcap=None, sinks=None, rope=None, q_norm=None, k_norm=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(qkv: PyRef<'_, PyNativeLinear>, o: PyRef<'_, PyNativeLinear>, scale: f32, window: Option<usize>,
           softcap: Option<f32>, sinks: Option<PyReadonlyArray1<'_, f32>>, rope: Option<usize>,
           q_norm: Option<PyReadonlyArray1<'_, f32>>, k_norm: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Self> {
        Ok(PyNativeAttention {
            inner: Attention {
                q_norm: floats(q_norm, "q_norm")?,
                k_norm: floats(k_norm, "k_norm")?,
                qkv: qkv.inner.clone(),
                o: o.inner.clone(),
                scores: Scores { scale, window, softcap },
                sinks: floats(sinks, "sinks")?,
                rope,
            },
        })
    }
}

/// LFM2's gated short convolution as a layer's mixer.
#[pyclass(name = "NativeShortConv", module = "guided._native", frozen)]
pub struct PyNativeShortConv {
    inner: ConvMixer,
}

#[pymethods]
impl PyNativeShortConv {
    /// `weight`: [hidden × kernel] taps, row-major, oldest first.
    #[new]
    #[pyo3(signature = (*, in_proj, out_proj, weight, bias=None))]
    fn new(in_proj: PyRef<'_, PyNativeLinear>, out_proj: PyRef<'_, PyNativeLinear>, weight: PyReadonlyArray1<'_, f32>,
           bias: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Self> {
        let conv = ShortConv { weight: weight.to_vec().map_err(|e| err("weight", e))?, bias: floats(bias, "bias")? };
        Ok(PyNativeShortConv { inner: ConvMixer { in_proj: in_proj.inner.clone(), conv, out_proj: out_proj.inner.clone() } })
    }
}

/// One layer: its mixer (NativeAttention or NativeShortConv), its MLP (NativeMlp or NativeMoe), its norms.
#[pyclass(name = "NativeLayer", module = "guided._native", frozen)]
pub struct PyNativeLayer {
    inner: Layer,
}

#[pymethods]
impl PyNativeLayer {
    #[new]
    #[pyo3(signature = (*, mixer, mlp, attn_norm=None, mlp_norm=None, attn_post_norm=None, mlp_post_norm=None))]
    fn new(mixer: &Bound<'_, PyAny>, mlp: &Bound<'_, PyAny>, attn_norm: Option<PyReadonlyArray1<'_, f32>>,
           mlp_norm: Option<PyReadonlyArray1<'_, f32>>, attn_post_norm: Option<PyReadonlyArray1<'_, f32>>,
           mlp_post_norm: Option<PyReadonlyArray1<'_, f32>>) -> PyResult<Self> {
        let mixer = if let Ok(a) = mixer.cast::<PyNativeAttention>() {
            Mixer::Attention(a.get().inner.clone())
        } else if let Ok(c) = mixer.cast::<PyNativeShortConv>() {
            Mixer::ShortConv(c.get().inner.clone())
        } else {
            return Err(PyTypeError::new_err("mixer: a NativeAttention or a NativeShortConv"));
        };
        let mlp = if let Ok(m) = mlp.cast::<PyNativeMlp>() {
            Mlp::Dense(m.get().inner.clone())
        } else if let Ok(m) = mlp.cast::<PyNativeMoe>() {
            Mlp::Moe(Box::new(m.get().inner.clone()))
        } else {
            return Err(PyTypeError::new_err("mlp: a NativeMlp or a NativeMoe"));
        };
        Ok(PyNativeLayer {
            inner: Layer {
                attn_norm: floats(attn_norm, "attn_norm")?,
                mlp_norm: floats(mlp_norm, "mlp_norm")?,
                attn_post_norm: floats(attn_post_norm, "attn_post_norm")?,
                mlp_post_norm: floats(mlp_post_norm, "mlp_post_norm")?,
                mixer,
                mlp,
            },
        })
    }
}

/// A C-contiguous float32 array the decoder reads (or writes) in place, kept alive by the decoder.
fn borrowed<'py, D: numpy::ndarray::Dimension>(a: &Bound<'py, numpy::PyArray<f32, D>>, what: &str) -> PyResult<Borrowed> {
    if !a.is_c_contiguous() {
        return Err(err(what, "not C-contiguous"));
    }
    let owner: Py<PyAny> = a.clone().into_any().unbind();
    // SAFETY: the array's data stays where it is while the array lives, and `owner` keeps it alive
    Ok(unsafe { Borrowed::new(a.data(), a.len(), Box::new(owner)) })
}

/// A model's CPU step in native code (rust/cpu/native_step.rs).
#[pyclass(name = "CpuDecoder", module = "guided._native", frozen)]
pub struct PyCpuDecoder {
    inner: Arc<Decoder>,
}

#[pymethods]
impl PyCpuDecoder {
    /// `spec`: the model's shape and its architecture's choices; `embedding`: a float32
    /// [vocab, hidden] array (read in place) or a QuantMatrix (rows dequantized on lookup);
    /// `layers`: one record per layer; `lm_head`: the output head; `caches`: per layer a (K, V)
    /// pair of float32 [blocks, block_size, kv_heads, head_dim] arrays, written in place
    /// (a convolution layer's: [blocks, block_size, 1, hidden] and an empty V).
    #[new]
    #[pyo3(signature = (spec, embedding, layers, norm, lm_head, caches))]
    fn new(
        spec: PyRef<'_, PyNativeSpec>,
        embedding: Bound<'_, PyAny>,
        layers: Vec<PyRef<'_, PyNativeLayer>>,
        norm: PyReadonlyArray1<'_, f32>,
        lm_head: PyRef<'_, PyNativeLinear>,
        caches: Bound<'_, PyList>,
    ) -> PyResult<Self> {
        let embedding = if let Ok(m) = embedding.cast::<PyQuantMatrix>() {
            Embedding::Rows(m.get().inner.clone())
        } else {
            let a = embedding.cast::<PyArray2<f32>>().map_err(|_| PyTypeError::new_err("embedding: a QuantMatrix or a 2-D float32 array"))?;
            Embedding::Dense(borrowed(a, "embedding")?)
        };
        let layers = layers.iter().map(|l| l.inner.clone()).collect();
        let norm = norm.to_vec().map_err(|e| err("norm", e))?;
        let mut shape = None;
        let caches = caches
            .iter()
            .enumerate()
            .map(|(i, pair)| {
                let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = pair.extract()?;
                let what = format!("layer {i}'s cache");
                let k = k.cast::<PyArray4<f32>>().map_err(|_| PyTypeError::new_err(format!("{what}: 4-D float32 arrays")))?;
                let v = v.cast::<PyArray4<f32>>().map_err(|_| PyTypeError::new_err(format!("{what}: 4-D float32 arrays")))?;
                if k.shape()[..2] != v.shape()[..2] {
                    return Err(err(&what, "K and V differ in blocks or block size"));
                }
                shape = Some([k.shape()[0], k.shape()[1]]);
                Ok(Cache { k: borrowed(k, &what)?, v: borrowed(v, &what)? })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let [blocks, block_size] = shape.ok_or_else(|| err("caches", "none given"))?;
        let inner = Decoder::new(spec.inner.clone(), embedding, layers, norm, lm_head.inner.clone(), caches, blocks, block_size)
            .map_err(PyValueError::new_err)?;
        Ok(PyCpuDecoder { inner: Arc::new(inner) })
    }

    /// The logits [rows that sample, vocab] of a step (a StepPlan), its KV written into the caches.
    /// `rope`: each rotary table [positions, rotary_dim], float32 (cos, then sin).
    fn forward<'py>(&self, py: Python<'py>, plan: &Bound<'py, PyStepPlan>, rope: Vec<Bound<'py, PyArray2<f32>>>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let p = plan.get();
        let (ids, positions, slots) = (p.input_ids.bind(py).readonly(), p.positions.bind(py).readonly(), p.slot_mapping.bind(py).readonly());
        let (tables, starts, logit_rows) = (p.block_tables.bind(py).readonly(), p.query_start_loc.bind(py).readonly(), p.logits_indices.bind(py).readonly());
        let rope = rope.iter().map(|t| t.readonly()).collect::<Vec<_>>();
        let rope_slices = rope.iter().map(|t| t.as_slice().map_err(|_| err("rope", "not C-contiguous"))).collect::<PyResult<Vec<_>>>()?;
        let step = Step {
            ids: ids.as_slice()?,
            positions: positions.as_slice()?,
            slots: slots.as_slice()?,
            tables: tables.as_slice()?,
            max_blocks: tables.shape()[1],
            query_start: starts.as_slice()?,
            logit_rows: logit_rows.as_slice()?,
        };
        let vocab = self.inner.vocab_size();
        let mut logits = vec![0f32; step.logit_rows.len() * vocab];
        py.detach(|| self.inner.forward(&step, &rope_slices, &mut logits)).map_err(PyValueError::new_err)?;
        let rows = step.logit_rows.len();
        Ok(numpy::ndarray::Array2::from_shape_vec((rows, vocab), logits).expect("rows × vocab").into_pyarray(py))
    }

    /// Start timing each phase of every step (from zero): `profile(True)`; stop and get the
    /// seconds per phase, with "steps", "rows" and "total": `profile(False)` (None if it was off).
    fn profile<'py>(&self, py: Python<'py>, on: bool) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(p) = self.inner.profile(on) else { return Ok(None) };
        let d = PyDict::new(py);
        for (phase, secs) in crate::cpu::native_step::PHASES.iter().zip(p.seconds) {
            d.set_item(phase.name(), secs)?;
        }
        d.set_item("steps", p.steps)?;
        d.set_item("rows", p.rows)?;
        d.set_item("total", p.total)?;
        Ok(Some(d))
    }
}
