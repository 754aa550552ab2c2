//! PyO3 bindings for the CPU step (`cpu/native_step.rs`). Translation only: the
//! model comes in as plain dicts of arrays and matrices (built by
//! `python/guided/model/native.py` from the loaded model), with errors that
//! name the field that was wrong.

use std::sync::Arc;

use numpy::{IntoPyArray, PyArray2, PyArray4, PyArrayMethods, PyUntypedArrayMethods};
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

fn item<'py>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(d.get_item(key)?.filter(|v| !v.is_none()))
}

fn required<'py, T: for<'a> FromPyObject<'a, 'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    let v = item(d, key)?.ok_or_else(|| PyValueError::new_err(format!("{key} is missing")))?;
    v.extract::<T>().map_err(|_| PyTypeError::new_err(format!("{key} has the wrong type")))
}

fn optional<'py, T: for<'a> FromPyObject<'a, 'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<T>> {
    match item(d, key)? {
        Some(v) => v.extract::<T>().map(Some).map_err(|_| PyTypeError::new_err(format!("{key} has the wrong type"))),
        None => Ok(None),
    }
}

/// `key`'s value among `choices` (its name, and what it means), or an error naming the ones there are.
fn choice<T: Copy>(d: &Bound<'_, PyDict>, key: &str, choices: &[(&str, T)]) -> PyResult<Option<T>> {
    let Some(name) = optional::<String>(d, key)? else { return Ok(None) };
    match choices.iter().find(|(n, _)| *n == name) {
        Some(&(_, v)) => Ok(Some(v)),
        None => {
            let names: Vec<&str> = choices.iter().map(|c| c.0).collect();
            Err(err(key, format!("unknown {name:?} (one of {})", names.join(", "))))
        }
    }
}

fn required_choice<T: Copy>(d: &Bound<'_, PyDict>, key: &str, choices: &[(&str, T)]) -> PyResult<T> {
    choice(d, key, choices)?.ok_or_else(|| PyValueError::new_err(format!("{key} is missing")))
}

/// A float32 vector (norm weights, biases, sinks), copied.
fn floats(d: &Bound<'_, PyDict>, key: &str) -> PyResult<Option<Vec<f32>>> {
    match item(d, key)? {
        None => Ok(None),
        Some(v) => {
            let a = v.cast::<numpy::PyArray1<f32>>().map_err(|_| PyTypeError::new_err(format!("{key} must be a 1-D float32 array")))?;
            Ok(Some(a.to_vec().map_err(|e| err(key, e))?))
        }
    }
}

/// One stacked part: a QuantMatrix (shared) or a 2-D float32 array (repacked).
fn weight(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Weight> {
    if let Ok(m) = obj.cast::<PyQuantMatrix>() {
        return Ok(Weight::Quant(m.get().inner.clone()));
    }
    let a = obj.cast::<PyArray2<f32>>().map_err(|_| PyTypeError::new_err(format!("{what}: a QuantMatrix or a 2-D float32 array")))?;
    let ro = a.readonly();
    let (rows, cols) = (ro.shape()[0], ro.shape()[1]);
    let values = ro.as_slice().map_err(|_| err(what, "not C-contiguous"))?;
    DenseMatrix::new(rows, cols, values).map(Weight::Dense).map_err(|e| err(what, e))
}

/// {"parts": [...], "bias": array | None}
fn linear(d: &Bound<'_, PyDict>, key: &str, precise: bool) -> PyResult<Linear> {
    let l: Bound<'_, PyDict> = required(d, key)?;
    let parts: Bound<'_, PyList> = required(&l, "parts").map_err(|e| err(key, e))?;
    let parts = parts.iter().enumerate().map(|(i, p)| weight(&p, &format!("{key} part {i}"))).collect::<PyResult<Vec<_>>>()?;
    Linear::new(parts, floats(&l, "bias")?, precise).map_err(|e| err(key, e))
}

fn expert(d: &Bound<'_, PyDict>, what: &str) -> PyResult<Expert> {
    Ok(Expert {
        gate_up: linear(d, "gate_up", false).map_err(|e| err(what, e))?,
        down: linear(d, "down", false).map_err(|e| err(what, e))?,
    })
}

fn moe(d: &Bound<'_, PyDict>) -> PyResult<Moe> {
    let scoring = required_choice(d, "scoring", &[("softmax", Scoring::Softmax), ("softmax_topk", Scoring::SoftmaxTopK), ("sigmoid", Scoring::Sigmoid)])?;
    let experts: Bound<'_, PyList> = required(d, "experts")?;
    let experts = experts
        .iter()
        .enumerate()
        .map(|(i, e)| expert(e.cast::<PyDict>()?, &format!("expert {i}")))
        .collect::<PyResult<Vec<_>>>()?;
    let shared = match optional::<Bound<'_, PyDict>>(d, "shared")? {
        Some(s) => Some(expert(&s, "shared expert")?),
        None => None,
    };
    let routing = Routing {
        scoring,
        selection_bias: floats(d, "selection_bias")?,
        top_k: required(d, "top_k")?,
        norm_topk_prob: required(d, "norm_topk_prob")?,
        routed_scaling: required(d, "routed_scaling")?,
        groups: required(d, "groups")?,
        topk_groups: required(d, "topk_groups")?,
    };
    Ok(Moe { router: linear(d, "router", false)?, routing, experts, shared })
}

fn layer(d: &Bound<'_, PyDict>) -> PyResult<Layer> {
    let mlp: Bound<'_, PyDict> = required(d, "mlp")?;
    let mlp = match optional::<Bound<'_, PyDict>>(&mlp, "moe")? {
        Some(m) => Mlp::Moe(Box::new(moe(&m)?)),
        None => Mlp::Dense(expert(&mlp, "mlp")?),
    };
    let mixer = match optional::<Bound<'_, PyDict>>(d, "conv")? {
        Some(c) => Mixer::ShortConv(ConvMixer {
            in_proj: linear(&c, "in_proj", false)?,
            conv: ShortConv { weight: floats(&c, "weight")?.ok_or_else(|| err("conv", "no weight"))?, bias: floats(&c, "bias")? },
            out_proj: linear(&c, "out_proj", false)?,
        }),
        None => Mixer::Attention(Attention {
            q_norm: floats(d, "q_norm")?,
            k_norm: floats(d, "k_norm")?,
            qkv: linear(d, "qkv", false)?,
            o: linear(d, "o", false)?,
            scores: Scores { scale: required(d, "scale")?, window: optional(d, "window")?, softcap: optional(d, "softcap")? },
            sinks: floats(d, "sinks")?,
            rope: optional(d, "rope")?,
        }),
    };
    Ok(Layer {
        attn_norm: floats(d, "attn_norm")?,
        mlp_norm: floats(d, "mlp_norm")?,
        attn_post_norm: floats(d, "attn_post_norm")?,
        mlp_post_norm: floats(d, "mlp_post_norm")?,
        mixer,
        mlp,
    })
}

fn spec(d: &Bound<'_, PyDict>) -> PyResult<Spec> {
    let norms = required_choice(d, "norms", &[("pre", Norms::Pre), ("post", Norms::Post), ("sandwich", Norms::Sandwich), ("parallel", Norms::Parallel)])?;
    let norm_kind = required_choice(d, "norm_kind", &[("rms", NormKind::Rms), ("layer", NormKind::Layer)])?;
    let qk_norm = choice(d, "qk_norm", &[("head", QkNorm::Head), ("full", QkNorm::Full)])?;
    let oai = Activation::SwigluOai { alpha: required(d, "swiglu_alpha")?, limit: required(d, "swiglu_limit")? };
    let activation = required_choice(d, "activation", &[("silu", Activation::Silu), ("gelu_tanh", Activation::GeluTanh), ("swiglu_oai", oai)])?;
    Ok(Spec {
        hidden: required(d, "hidden")?,
        heads: required(d, "heads")?,
        kv_heads: required(d, "kv_heads")?,
        head_dim: required(d, "head_dim")?,
        rotary_dim: required(d, "rotary_dim")?,
        eps: required(d, "eps")?,
        norms,
        norm_kind,
        qk_norm,
        qk_norm_after_rope: required(d, "qk_norm_after_rope")?,
        activation,
        residual_multiplier: required(d, "residual_multiplier")?,
        embedding_multiplier: required(d, "embedding_multiplier")?,
        logit_multiplier: required(d, "logit_multiplier")?,
        final_softcap: optional(d, "final_softcap")?,
    })
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
    /// `layers`: one dict per layer; `lm_head`: {"parts", "bias", "precise"}; `caches`: per
    /// layer a (K, V) pair of float32 [blocks, block_size, kv_heads, head_dim] arrays, written in place
    /// (a convolution layer's: [blocks, block_size, 1, hidden] and an empty V).
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        spec_: Bound<'_, PyDict>,
        embedding: Bound<'_, PyAny>,
        layers: Bound<'_, PyList>,
        norm: Bound<'_, PyAny>,
        lm_head: Bound<'_, PyDict>,
        caches: Bound<'_, PyList>,
    ) -> PyResult<Self> {
        let spec = spec(&spec_)?;
        let embedding = if let Ok(m) = embedding.cast::<PyQuantMatrix>() {
            Embedding::Rows(m.get().inner.clone())
        } else {
            let a = embedding.cast::<PyArray2<f32>>().map_err(|_| PyTypeError::new_err("embedding: a QuantMatrix or a 2-D float32 array"))?;
            Embedding::Dense(borrowed(a, "embedding")?)
        };
        let layers = layers
            .iter()
            .enumerate()
            .map(|(i, l)| layer(l.cast::<PyDict>()?).map_err(|e| err(&format!("layer {i}"), e)))
            .collect::<PyResult<Vec<_>>>()?;
        let norm = norm.cast::<numpy::PyArray1<f32>>().map_err(|_| PyTypeError::new_err("norm: a 1-D float32 array"))?.to_vec().map_err(|e| err("norm", e))?;
        let precise: bool = optional(&lm_head, "precise")?.unwrap_or(false);
        let wrapper = PyDict::new(lm_head.py());
        wrapper.set_item("lm_head", &lm_head)?;
        let head = linear(&wrapper, "lm_head", precise)?;
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
        let inner = Decoder::new(spec, embedding, layers, norm, head, caches, blocks, block_size).map_err(PyValueError::new_err)?;
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
