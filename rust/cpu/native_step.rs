//! The CPU step: every decoder layer of every row of a step in native code.
//!
//! One `forward` runs a step's rows (decodes, prefill chunks, forced tokens,
//! draft rows) through the embedding, every layer and the output head, and
//! returns the logits of the rows that sample. A layer is the one decoder
//! every architecture runs (`python/guided/model/decoder.py` is its torch
//! twin, the reference it is tested against): what differs between
//! architectures comes in as data read from the architecture's row
//! (`Spec`: where the norms sit, q/k norms, the activation, multipliers,
//! soft-caps; per layer its window, rotary table and sinks), so a new
//! architecture is a row there, not code here.
//!
//! The matmuls are `packed.rs`'s multi-row kernels (or ggml's one-row
//! kernels for formats without a packing, or `dense.rs` for float weights)
//! and attention is `cpu_attention.rs`; all parallel loops run on `pool.rs`'s
//! threads. Every operation on a row depends on that row alone, so a
//! request's logits are the same in any batch, chunking or cache state.

use std::sync::{Arc, Mutex};

use crate::cpu::cpu_attention::{self, Layout, Rows, Scores};
use crate::cpu::dense::DenseMatrix;
pub use crate::cpu::layer_ops::Activation;
use crate::cpu::layer_ops::{activate_row, norm, norm_rows, per_rows2, rms_norm_in_place, rotate, PARALLEL_ROWS};
pub use crate::cpu::layer_ops::NormKind;
pub use crate::cpu::expert_routing::{Routing, Scoring};
use crate::cpu::expert_routing::route;
use crate::cpu::activations::Activations;
use crate::threads::pool::{self, SendPtr};
use crate::cpu::quant::QuantMatrix;
use crate::cpu::gated_conv::{ConvRows, ShortConv};
pub use crate::cpu::step_profile::{Phase, Profile, PHASES};

/// Where a layer's RMSNorms sit (architectures.py's `norms`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Norms {
    /// norm → sublayer → add (Llama)
    Pre,
    /// sublayer → norm → add (OLMo 2, EXAONE 4)
    Post,
    /// norm → sublayer → norm → add (Gemma 2 and 3)
    Sandwich,
    /// one norm, then attention and the MLP side by side, both added (Cohere 2)
    Parallel,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// per head (Qwen3)
    Head,
    /// over all heads at once (OLMo 2)
    Full,
}

/// The model's shape and the architecture's choices.
#[derive(Clone, Debug)]
pub struct Spec {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// the leading part of each head that rotates
    pub rotary_dim: usize,
    pub eps: f32,
    pub norms: Norms,
    pub norm_kind: NormKind,
    pub qk_norm: Option<QkNorm>,
    pub qk_norm_after_rope: bool,
    pub activation: Activation,
    pub residual_multiplier: f32,
    pub embedding_multiplier: f32,
    pub logit_multiplier: f32,
    pub final_softcap: Option<f32>,
}

/// A weight matrix the step multiplies by (shared: a record built once may
/// be handed to several decoders without copying its values).
#[derive(Clone)]
pub enum Weight {
    Quant(Arc<QuantMatrix>),
    Dense(Arc<DenseMatrix>),
}

impl Weight {
    fn rows(&self) -> usize {
        match self {
            Weight::Quant(m) => m.rows,
            Weight::Dense(m) => m.rows,
        }
    }
    fn cols(&self) -> usize {
        match self {
            Weight::Quant(m) => m.cols,
            Weight::Dense(m) => m.cols,
        }
    }
}

/// A linear layer: one matrix or several stacked by rows (q|k|v in different
/// formats), and a bias.
#[derive(Clone)]
pub struct Linear {
    parts: Vec<Weight>,
    bias: Option<Vec<f32>>,
    pub rows: usize,
    pub cols: usize,
    /// quantized activations get a second pass over their rounding error (the output head)
    precise: bool,
}

impl Linear {
    pub fn new(parts: Vec<Weight>, bias: Option<Vec<f32>>, precise: bool) -> Result<Linear, String> {
        let cols = parts.first().ok_or("a linear layer without weights")?.cols();
        if let Some(p) = parts.iter().find(|p| p.cols() != cols) {
            return Err(format!("stacked weights differ in width: {} and {cols} columns", p.cols()));
        }
        let rows = parts.iter().map(Weight::rows).sum();
        if let Some(b) = &bias {
            if b.len() != rows {
                return Err(format!("a bias of {} values for {rows} outputs", b.len()));
            }
        }
        Ok(Linear { parts, bias, rows, cols, precise })
    }

    /// out [t, rows] = x [t, cols] · Wᵀ + b, its time charged to `phase`.
    fn forward(&self, x: &[f32], out: &mut [f32], bufs: &mut Buffers, phase: Phase) {
        let t = x.len() / self.cols;
        if self.parts.iter().any(|p| matches!(p, Weight::Quant(m) if m.packed().is_some())) {
            bufs.act.quantize(x, self.cols, self.precise);
            bufs.mark(Phase::Quantize);
        }
        let single = self.parts.len() == 1;
        let mut at = 0;
        for part in &self.parts {
            let rows = part.rows();
            let target: &mut [f32] = if single {
                &mut out[..t * rows]
            } else {
                bufs.part.resize(t * rows, 0.0);
                &mut bufs.part[..]
            };
            match part {
                Weight::Quant(m) => match m.packed() {
                    Some(p) => p.matmul(&bufs.act, target),
                    None => m.matmul(x, target, self.precise),
                },
                Weight::Dense(m) => m.matmul(x, target),
            }
            if !single {
                for r in 0..t {
                    out[r * self.rows + at..][..rows].copy_from_slice(&bufs.part[r * rows..][..rows]);
                }
            }
            at += rows;
        }
        if let Some(bias) = &self.bias {
            for row in out.chunks_exact_mut(self.rows) {
                row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
        }
        bufs.mark(phase);
    }
}

#[derive(Clone)]
pub struct Expert {
    pub gate_up: Linear,
    pub down: Linear,
}

/// A mixture-of-experts MLP (model/moe.py's): a router, its routing, the experts.
#[derive(Clone)]
pub struct Moe {
    pub router: Linear,
    pub routing: Routing,
    pub experts: Vec<Expert>,
    pub shared: Option<Expert>,
}

#[derive(Clone)]
pub enum Mlp {
    Dense(Expert),
    Moe(Box<Moe>),
}

/// A layer's token mixer: attention, or LFM2's gated short convolution.
#[derive(Clone)]
pub enum Mixer {
    Attention(Attention),
    ShortConv(ConvMixer),
}

/// LFM2's mixer: in_proj [3·hidden, hidden] gives B, C and x, the convolution mixes
/// them (gated_conv.rs), out_proj [hidden, hidden].
#[derive(Clone)]
pub struct ConvMixer {
    pub in_proj: Linear,
    pub conv: ShortConv,
    pub out_proj: Linear,
}

#[derive(Clone)]
pub struct Attention {
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub qkv: Linear,
    pub o: Linear,
    pub scores: Scores,
    /// gpt-oss: a logit per head that joins its softmax
    pub sinks: Option<Vec<f32>>,
    /// which rotary table the layer uses (None: it does not rotate)
    pub rope: Option<usize>,
}

#[derive(Clone)]
pub struct Layer {
    /// the mixer's input norm (attention's or the convolution's)
    pub attn_norm: Option<Vec<f32>>,
    pub mlp_norm: Option<Vec<f32>>,
    pub attn_post_norm: Option<Vec<f32>>,
    pub mlp_post_norm: Option<Vec<f32>>,
    pub mixer: Mixer,
    pub mlp: Mlp,
}

impl Layer {
    fn rope(&self) -> Option<usize> {
        match &self.mixer {
            Mixer::Attention(a) => a.rope,
            Mixer::ShortConv(_) => None,
        }
    }
}

/// A float array owned elsewhere (a numpy array the Python side holds),
/// kept alive by `owner` for as long as this lives.
pub struct Borrowed {
    ptr: *mut f32,
    len: usize,
    _owner: Box<dyn Send + Sync>,
}

// SAFETY: the memory is the owner's, which is Send + Sync and outlives this;
// writes (the KV cache) happen only inside `forward`, which holds the step lock.
unsafe impl Send for Borrowed {}
unsafe impl Sync for Borrowed {}

impl Borrowed {
    /// # Safety
    /// `ptr` must point at `len` f32 that stay valid (and are not moved) while `owner` lives.
    pub unsafe fn new(ptr: *mut f32, len: usize, owner: Box<dyn Send + Sync>) -> Borrowed {
        Borrowed { ptr, len, _owner: owner }
    }

    fn slice(&self) -> &[f32] {
        // SAFETY: see new
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// # Safety
    /// No other reference to the memory may be in use (the step lock).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self) -> &mut [f32] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// The token embeddings: a float table, or the rows of a quantized matrix
/// (the output head's, where the two are tied), dequantized on lookup.
pub enum Embedding {
    Dense(Borrowed),
    Rows(Arc<QuantMatrix>),
}

/// A layer's K and V caches, [blocks, block_size, kv_heads, head_dim] each (a convolution
/// layer's: each token's B·x in `k`, [blocks, block_size, hidden], and `v` empty).
pub struct Cache {
    pub k: Borrowed,
    pub v: Borrowed,
}

/// One step's rows, as the scheduler plans them (`StepPlan`).
pub struct Step<'a> {
    pub ids: &'a [i64],
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    /// [sequences, max_blocks]
    pub tables: &'a [i32],
    pub max_blocks: usize,
    /// sequence b owns rows query_start[b]..query_start[b + 1]
    pub query_start: &'a [i32],
    /// the rows whose logits come back, in order
    pub logit_rows: &'a [i64],
}

/// Buffers a step reuses, so a decode step allocates nothing.
#[derive(Default)]
struct Buffers {
    /// Some while profiling, with the time of the last mark
    profile: Option<(Profile, std::time::Instant)>,
    act: Activations,
    part: Vec<f32>,
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    up: Vec<f32>,
    mid: Vec<f32>,
    seq: Vec<i32>,
    pos: Vec<i32>,
    moe: MoeBuffers,
}

impl Buffers {
    /// Charge the time since the last mark to `phase` (nothing unless profiling).
    fn mark(&mut self, phase: Phase) {
        if let Some((profile, last)) = &mut self.profile {
            let now = std::time::Instant::now();
            profile.seconds[PHASES.iter().position(|&p| p == phase).expect("a phase")] += (now - *last).as_secs_f64();
            *last = now;
        }
    }
}

#[derive(Default)]
struct MoeBuffers {
    logits: Vec<f32>,
    /// each (token, choice)'s weighted expert output
    results: Vec<f32>,
    rows: Vec<f32>,
    out: Vec<f32>,
    up: Vec<f32>,
    mid: Vec<f32>,
    shared: Vec<f32>,
}

pub struct Decoder {
    spec: Spec,
    embedding: Embedding,
    vocab: usize,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: Linear,
    caches: Vec<Cache>,
    num_blocks: usize,
    block_size: usize,
    /// one step at a time: the step's buffers and the KV caches it writes
    step: Mutex<Buffers>,
}

impl Decoder {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: Spec,
        embedding: Embedding,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Linear,
        caches: Vec<Cache>,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Decoder, String> {
        let s = &spec;
        let vocab = lm_head.rows;
        let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        if s.kv_heads == 0 || s.heads % s.kv_heads != 0 {
            return Err(format!("{} heads are not a multiple of {} KV heads", s.heads, s.kv_heads));
        }
        if s.rotary_dim > s.head_dim || s.rotary_dim % 2 != 0 {
            return Err(format!("a rotary part of {} in heads of {}", s.rotary_dim, s.head_dim));
        }
        match &embedding {
            Embedding::Dense(e) if e.len % s.hidden != 0 => return Err(format!("embeddings of {} values are not rows of {}", e.len, s.hidden)),
            Embedding::Rows(m) if m.cols != s.hidden => return Err(format!("embedding rows of {}, hidden size {}", m.cols, s.hidden)),
            _ => {}
        }
        let width = |what: &str, l: &Linear, rows: usize, cols: usize| {
            if l.rows != rows || l.cols != cols {
                Err(format!("{what} is [{}, {}], not [{rows}, {cols}]", l.rows, l.cols))
            } else {
                Ok(())
            }
        };
        width("the output head", &lm_head, vocab, s.hidden)?;
        check_len("the final norm", Some(&norm), s.hidden)?;
        if caches.len() != layers.len() {
            return Err(format!("{} caches for {} layers", caches.len(), layers.len()));
        }
        let (cache_len, conv_len) = (num_blocks * block_size * kv, num_blocks * block_size * s.hidden);
        if s.norm_kind == NormKind::Layer && (matches!(s.norms, Norms::Post | Norms::Sandwich) || s.qk_norm.is_some()) {
            return Err(format!("LayerNorm runs where a layer's input is normed, not after its sublayers or on q/k ({:?} norms)", s.norms));
        }
        for (i, (layer, cache)) in layers.iter().zip(&caches).enumerate() {
            let at = |what: &str| format!("layer {i}: {what}");
            for (what, norm) in [("attn_norm", &layer.attn_norm), ("mlp_norm", &layer.mlp_norm)] {
                let absent = s.norms == Norms::Post || (what == "mlp_norm" && s.norms == Norms::Parallel);
                check_len(&at(what), norm.as_ref().filter(|_| !absent), s.hidden)?;
                if absent && norm.is_some() {
                    return Err(at(&format!("{what} where the architecture has none ({:?} norms)", s.norms)));
                }
            }
            for (what, norm) in [("attn_post_norm", &layer.attn_post_norm), ("mlp_post_norm", &layer.mlp_post_norm)] {
                check_len(&at(what), norm.as_ref().filter(|_| !matches!(s.norms, Norms::Pre | Norms::Parallel)), s.hidden)?;
            }
            match &layer.mixer {
                Mixer::Attention(a) => {
                    width(&at("qkv"), &a.qkv, q + 2 * kv, s.hidden)?;
                    width(&at("o"), &a.o, s.hidden, q)?;
                    let (qn, kn) = match s.qk_norm {
                        Some(QkNorm::Head) => (s.head_dim, s.head_dim),
                        Some(QkNorm::Full) => (q, kv),
                        None => (0, 0),
                    };
                    if s.qk_norm.is_some() {
                        check_len(&at("q_norm"), a.q_norm.as_ref(), qn)?;
                        check_len(&at("k_norm"), a.k_norm.as_ref(), kn)?;
                    }
                    if a.sinks.as_ref().is_some_and(|sinks| sinks.len() != s.heads) {
                        return Err(at(&format!("sinks that are not one per head ({})", s.heads)));
                    }
                    if cache.k.len != cache_len || cache.v.len != cache_len {
                        return Err(at(&format!("caches of {} and {} values, not {cache_len}", cache.k.len, cache.v.len)));
                    }
                }
                Mixer::ShortConv(c) => {
                    width(&at("in_proj"), &c.in_proj, 3 * s.hidden, s.hidden)?;
                    width(&at("out_proj"), &c.out_proj, s.hidden, s.hidden)?;
                    c.conv.check(s.hidden).map_err(|e| at(&e))?;
                    if cache.k.len != conv_len || cache.v.len != 0 {
                        return Err(at(&format!("a convolution cache of {} and {} values, not {conv_len} and 0", cache.k.len, cache.v.len)));
                    }
                }
            }
            match &layer.mlp {
                Mlp::Dense(e) => check_expert(&at("mlp"), e, s.hidden)?,
                Mlp::Moe(m) => {
                    width(&at("router"), &m.router, m.experts.len(), s.hidden)?;
                    let r = &m.routing;
                    if r.top_k == 0 || r.top_k > m.experts.len() || r.groups == 0 || m.experts.len() % r.groups != 0 || r.topk_groups > r.groups {
                        return Err(at(&format!("top {} of {} experts in {} groups", r.top_k, m.experts.len(), r.groups)));
                    }
                    if r.selection_bias.as_ref().is_some_and(|b| b.len() != m.experts.len()) {
                        return Err(at("a selection bias that is not one per expert"));
                    }
                    for (e, expert) in m.experts.iter().chain(&m.shared).enumerate() {
                        check_expert(&at(&format!("expert {e}")), expert, s.hidden)?;
                    }
                }
            }
        }
        let vocab_rows = match &embedding {
            Embedding::Dense(e) => e.len / s.hidden,
            Embedding::Rows(m) => m.rows,
        };
        Ok(Decoder {
            vocab: vocab_rows,
            spec,
            embedding,
            layers,
            norm,
            lm_head,
            caches,
            num_blocks,
            block_size,
            step: Mutex::new(Buffers::default()),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.lm_head.rows
    }

    /// Run a step: the KV caches are written for every row, and `logits`
    /// [step.logit_rows.len(), vocab] filled. `rope`: each rotary table
    /// [positions, rotary_dim] (cos in the first half, sin in the second).
    pub fn forward(&self, step: &Step, rope: &[&[f32]], logits: &mut [f32]) -> Result<(), String> {
        let mut guard = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let bufs = &mut *guard;
        self.check(step, rope, logits, bufs)?;
        let start = std::time::Instant::now();
        if let Some((_, last)) = &mut bufs.profile {
            *last = start;
        }
        let s = &self.spec;
        let t = step.ids.len();
        let hidden = s.hidden;
        let mut x = std::mem::take(&mut bufs.x);
        x.resize(t * hidden, 0.0);
        self.embed(step.ids, &mut x);
        bufs.mark(Phase::Embed);
        for (layer, cache) in self.layers.iter().zip(&self.caches) {
            self.layer(layer, cache, step, rope, &mut x, bufs);
        }
        // the final norm and the head, for the rows that sample
        let r = step.logit_rows.len();
        let mut h = std::mem::take(&mut bufs.h);
        h.resize(r * hidden, 0.0);
        for (i, &row) in step.logit_rows.iter().enumerate() {
            norm(s.norm_kind, &x[row as usize * hidden..][..hidden], &self.norm, s.eps, &mut h[i * hidden..][..hidden]);
        }
        bufs.mark(Phase::Norms);
        if r > 0 {
            self.lm_head.forward(&h, logits, bufs, Phase::Head);
            let (m, cap) = (s.logit_multiplier, s.final_softcap);
            if m != 1.0 || cap.is_some() {
                for l in logits.iter_mut() {
                    if m != 1.0 {
                        *l *= m;
                    }
                    if let Some(c) = cap {
                        *l = (*l / c).tanh() * c;
                    }
                }
            }
        }
        bufs.mark(Phase::Head);
        bufs.x = x;
        bufs.h = h;
        if let Some((p, _)) = &mut bufs.profile {
            p.steps += 1;
            p.rows += step.ids.len();
            p.total += start.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Start timing each phase of every step (from zero), or stop and return what was timed.
    pub fn profile(&self, on: bool) -> Option<Profile> {
        let mut bufs = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let before = bufs.profile.take().map(|(p, _)| p);
        if on {
            bufs.profile = Some((Profile::default(), std::time::Instant::now()));
        }
        before
    }

    fn check(&self, step: &Step, rope: &[&[f32]], logits: &[f32], bufs: &mut Buffers) -> Result<(), String> {
        let t = step.ids.len();
        if step.positions.len() != t || step.slots.len() != t {
            return Err(format!("{t} tokens with {} positions and {} slots", step.positions.len(), step.slots.len()));
        }
        if logits.len() != step.logit_rows.len() * self.vocab_size() {
            return Err(format!("logits for {} rows of {} tokens", step.logit_rows.len(), self.vocab_size()));
        }
        if let Some(r) = step.logit_rows.iter().find(|&&r| r < 0 || r as usize >= t) {
            return Err(format!("logits asked for row {r} of {t}"));
        }
        if let Some(id) = step.ids.iter().find(|&&id| id < 0 || id as usize >= self.vocab) {
            return Err(format!("token id {id} is outside the vocabulary (0..{})", self.vocab));
        }
        let slots = (self.num_blocks * self.block_size) as i64;
        if let Some(s) = step.slots.iter().find(|&&s| s < 0 || s >= slots) {
            return Err(format!("slot {s} is outside the KV cache (0..{slots})"));
        }
        let qs = step.query_start;
        let seqs = qs.len().saturating_sub(1);
        if qs.first() != Some(&0) || qs.last().map(|&l| l as usize) != Some(t) || qs.windows(2).any(|w| w[1] < w[0]) {
            return Err(format!("query_start_loc {qs:?} does not split {t} rows"));
        }
        if step.max_blocks == 0 || step.tables.len() != seqs * step.max_blocks {
            return Err(format!("block tables of {} entries for {seqs} sequences", step.tables.len()));
        }
        for (k, table) in rope.iter().enumerate() {
            let used = self.layers.iter().any(|l| l.rope() == Some(k));
            let need = step.positions.iter().map(|&p| p + 1).max().unwrap_or(0) as usize * self.spec.rotary_dim;
            if used && table.len() < need {
                return Err(format!("rotary table {k} has {} values, positions need {need}", table.len()));
            }
        }
        if let Some(k) = self.layers.iter().filter_map(Layer::rope).find(|&k| k >= rope.len()) {
            return Err(format!("a layer uses rotary table {k} of {}", rope.len()));
        }
        if let Some(p) = step.positions.iter().find(|&&p| p < 0 || p as usize >= step.max_blocks * self.block_size) {
            return Err(format!("position {p} is outside the block tables"));
        }
        bufs.seq.clear();
        for b in 0..seqs {
            bufs.seq.extend(std::iter::repeat_n(b as i32, (qs[b + 1] - qs[b]) as usize));
        }
        bufs.pos.clear();
        bufs.pos.extend(step.positions.iter().map(|&p| p as i32));
        // every block a row reads lies in the caches (checked here, before any KV is written)
        for (r, (&b, &p)) in bufs.seq.iter().zip(&bufs.pos).enumerate() {
            let table = &step.tables[b as usize * step.max_blocks..][..p as usize / self.block_size + 1];
            if let Some(block) = table.iter().find(|&&x| x < 0 || x as usize >= self.num_blocks) {
                return Err(format!("row {r}'s block table names block {block}, outside 0..{}", self.num_blocks));
            }
        }
        Ok(())
    }

    fn embed(&self, ids: &[i64], x: &mut [f32]) {
        let hidden = self.spec.hidden;
        let m = self.spec.embedding_multiplier;
        for (row, &id) in x.chunks_exact_mut(hidden).zip(ids) {
            match &self.embedding {
                Embedding::Dense(e) => row.copy_from_slice(&e.slice()[id as usize * hidden..][..hidden]),
                Embedding::Rows(q) => q.dequantize_row(id as usize, row),
            }
            if m != 1.0 {
                row.iter_mut().for_each(|v| *v *= m);
            }
        }
    }

    fn layer(&self, layer: &Layer, cache: &Cache, step: &Step, rope: &[&[f32]], x: &mut [f32], bufs: &mut Buffers) {
        let s = &self.spec;
        let (t, hidden) = (step.ids.len(), s.hidden);
        let norm_in = s.norms != Norms::Post;
        // attention
        let mut h = std::mem::take(&mut bufs.h);
        h.resize(t * hidden, 0.0);
        let input: &[f32] = if norm_in {
            norm_rows(s.norm_kind, x, layer.attn_norm.as_deref().expect("checked"), s.eps, &mut h);
            &h
        } else {
            x
        };
        bufs.mark(Phase::Norms);
        let mut o = std::mem::take(&mut bufs.o);
        o.resize(t * hidden, 0.0);
        match &layer.mixer {
            Mixer::Attention(a) => self.attention(a, cache, step, rope, input, &mut o, bufs),
            Mixer::ShortConv(c) => self.short_conv(c, cache, step, input, &mut o, bufs),
        }
        self.residual(x, &mut o, layer.attn_post_norm.as_deref());
        // MLP (side by side with attention: on the same normed input)
        let input: &[f32] = if s.norms == Norms::Parallel {
            &h
        } else if norm_in {
            norm_rows(s.norm_kind, x, layer.mlp_norm.as_deref().expect("checked"), s.eps, &mut h);
            &h
        } else {
            x
        };
        bufs.mark(Phase::Norms);
        match &layer.mlp {
            Mlp::Dense(e) => {
                let (mut up, mut mid) = (std::mem::take(&mut bufs.up), std::mem::take(&mut bufs.mid));
                self.expert(e, input, &mut o, &mut up, &mut mid, bufs);
                bufs.up = up;
                bufs.mid = mid;
            }
            Mlp::Moe(m) => self.moe(m, input, &mut o, bufs),
        }
        self.residual(x, &mut o, layer.mlp_post_norm.as_deref());
        bufs.mark(Phase::Norms);
        bufs.h = h;
        bufs.o = o;
    }

    /// Attention over the paged cache: `input` [t, hidden] → `o` [t, hidden].
    #[allow(clippy::too_many_arguments)]
    fn attention(&self, a: &Attention, cache: &Cache, step: &Step, rope: &[&[f32]], input: &[f32], o: &mut [f32], bufs: &mut Buffers) {
        let s = &self.spec;
        let mut qkv = std::mem::take(&mut bufs.qkv);
        qkv.resize(step.ids.len() * a.qkv.rows, 0.0);
        a.qkv.forward(input, &mut qkv, bufs, Phase::Qkv);
        let mut q = std::mem::take(&mut bufs.q);
        q.resize(step.ids.len() * s.heads * s.head_dim, 0.0);
        // SAFETY: the step lock is held; each row writes its own slots
        let (kc, vc) = unsafe { (cache.k.slice_mut(), cache.v.slice_mut()) };
        self.place_qkv(a, step, rope, &mut qkv, &mut q, kc, vc);
        bufs.mark(Phase::Rope);
        let mut attn = std::mem::take(&mut bufs.attn);
        attn.resize(q.len(), 0.0);
        let layout = Layout {
            heads: s.heads,
            kv_heads: s.kv_heads,
            head_size: s.head_dim,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            max_blocks: step.max_blocks,
        };
        let rows = Rows { tables: step.tables, seq: &bufs.seq, pos: &bufs.pos };
        cpu_attention::paged_attention(&layout, &q, cache.k.slice(), cache.v.slice(), &rows, a.scores, a.sinks.as_deref(), &mut attn, true)
            .expect("checked with the step");
        bufs.mark(Phase::Attention);
        a.o.forward(&attn, o, bufs, Phase::Output);
        bufs.qkv = qkv;
        bufs.q = q;
        bufs.attn = attn;
    }

    /// LFM2's gated short convolution (gated_conv.rs): `input` [t, hidden] → `o` [t, hidden].
    fn short_conv(&self, c: &ConvMixer, cache: &Cache, step: &Step, input: &[f32], o: &mut [f32], bufs: &mut Buffers) {
        let mut bcx = std::mem::take(&mut bufs.qkv);
        bcx.resize(step.ids.len() * c.in_proj.rows, 0.0);
        c.in_proj.forward(input, &mut bcx, bufs, Phase::Qkv);
        let mut mixed = std::mem::take(&mut bufs.attn);
        mixed.resize(o.len(), 0.0);
        let rows = ConvRows { slots: step.slots, tables: step.tables, max_blocks: step.max_blocks, block_size: self.block_size, seq: &bufs.seq, pos: &bufs.pos };
        // SAFETY: the step lock is held
        c.conv.mix(&bcx, &rows, unsafe { cache.k.slice_mut() }, &mut mixed);
        bufs.mark(Phase::Attention);
        c.out_proj.forward(&mixed, o, bufs, Phase::Output);
        bufs.qkv = bcx;
        bufs.attn = mixed;
    }

    /// x += norm(h)·residual_multiplier (the norm where the architecture puts one after the sublayer).
    fn residual(&self, x: &mut [f32], h: &mut [f32], post_norm: Option<&[f32]>) {
        let s = &self.spec;
        let m = s.residual_multiplier;
        let work = |x: &mut [f32], h: &mut [f32]| {
            for (xr, hr) in x.chunks_exact_mut(s.hidden).zip(h.chunks_exact_mut(s.hidden)) {
                if let Some(w) = post_norm {
                    rms_norm_in_place(hr, w, s.eps);
                }
                for (a, b) in xr.iter_mut().zip(hr.iter()) {
                    *a += if m != 1.0 { *b * m } else { *b };
                }
            }
        };
        per_rows2(x, h, s.hidden, s.hidden, work);
    }

    /// The gated MLP: out = down(f(gate, up)) for `input` [t, hidden].
    fn expert(&self, e: &Expert, input: &[f32], out: &mut [f32], up: &mut Vec<f32>, mid: &mut Vec<f32>, bufs: &mut Buffers) {
        let t = input.len() / self.spec.hidden;
        let inter = e.gate_up.rows / 2;
        up.resize(t * e.gate_up.rows, 0.0);
        e.gate_up.forward(input, up, bufs, Phase::GateUp);
        mid.resize(t * inter, 0.0);
        let act = self.spec.activation;
        per_rows2(up, mid, 2 * inter, inter, |up: &mut [f32], mid: &mut [f32]| {
            for (gu, m) in up.chunks_exact(2 * inter).zip(mid.chunks_exact_mut(inter)) {
                let (g, u) = gu.split_at(inter);
                activate_row(act, g, u, m);
            }
        });
        bufs.mark(Phase::Activation);
        e.down.forward(mid, &mut out[..t * self.spec.hidden], bufs, Phase::Down);
    }

    fn moe(&self, m: &Moe, input: &[f32], out: &mut [f32], bufs: &mut Buffers) {
        let hidden = self.spec.hidden;
        let t = input.len() / hidden;
        let n = m.experts.len();
        let mut mb = std::mem::take(&mut bufs.moe);
        mb.logits.resize(t * n, 0.0);
        m.router.forward(input, &mut mb.logits, bufs, Phase::Experts);
        // per token: its experts and weights, experts in ascending order (the order their outputs add up)
        let mut chosen: Vec<Vec<(usize, f32)>> = mb.logits.chunks_exact(n).map(|l| route(&m.routing, l)).collect();
        chosen.iter_mut().for_each(|c| c.sort_by_key(|&(e, _)| e));
        let mut by_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n]; // (token, its k-th choice)
        for (tok, c) in chosen.iter().enumerate() {
            for (k, &(e, _)) in c.iter().enumerate() {
                by_expert[e].push((tok, k));
            }
        }
        let k = m.routing.top_k;
        // each (token, choice)'s weighted output, summed per token in expert order after
        let mut results = std::mem::take(&mut mb.results);
        results.clear();
        results.resize(t * k * hidden, 0.0);
        let (mut up, mut mid) = (std::mem::take(&mut mb.up), std::mem::take(&mut mb.mid));
        for (e, pairs) in by_expert.iter().enumerate() {
            if pairs.is_empty() {
                continue;
            }
            mb.rows.clear();
            for &(tok, _) in pairs {
                mb.rows.extend_from_slice(&input[tok * hidden..][..hidden]);
            }
            mb.out.resize(pairs.len() * hidden, 0.0);
            bufs.mark(Phase::Experts);
            let (rows, mut eo) = (std::mem::take(&mut mb.rows), std::mem::take(&mut mb.out));
            self.expert(&m.experts[e], &rows, &mut eo, &mut up, &mut mid, bufs);
            for (i, &(tok, c)) in pairs.iter().enumerate() {
                let w = chosen[tok][c].1;
                let dst = &mut results[(tok * k + c) * hidden..][..hidden];
                dst.iter_mut().zip(&eo[i * hidden..][..hidden]).for_each(|(d, v)| *d = v * w);
            }
            mb.rows = rows;
            mb.out = eo;
        }
        for tok in 0..t {
            let y = &mut out[tok * hidden..][..hidden];
            y.fill(0.0);
            for c in 0..chosen[tok].len() {
                y.iter_mut().zip(&results[(tok * k + c) * hidden..][..hidden]).for_each(|(a, b)| *a += b);
            }
        }
        bufs.mark(Phase::Experts);
        if let Some(shared) = &m.shared {
            let mut sh = std::mem::take(&mut mb.shared);
            sh.resize(t * hidden, 0.0);
            self.expert(shared, input, &mut sh, &mut up, &mut mid, bufs);
            out[..t * hidden].iter_mut().zip(&sh).for_each(|(a, b)| *a += b);
            mb.shared = sh;
        }
        mb.up = up;
        mb.mid = mid;
        mb.results = results;
        bufs.moe = mb;
    }

    /// Per row: q/k norms and rotation; q into `q` [t, heads, d]; k and v into their cache slots.
    #[allow(clippy::too_many_arguments)]
    fn place_qkv(&self, layer: &Attention, step: &Step, rope: &[&[f32]], qkv: &mut [f32], q: &mut [f32], kc: &mut [f32], vc: &mut [f32]) {
        let s = &self.spec;
        let (d, qs, kvs) = (s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let width = qs + 2 * kvs;
        let table = layer.rope.map(|k| rope[k]);
        let (kc, vc) = (SendPtr(kc.as_mut_ptr()), SendPtr(vc.as_mut_ptr()));
        let work = |first: usize, rows: &mut [f32], qo: &mut [f32]| {
            for (i, (row, qo)) in rows.chunks_exact_mut(width).zip(qo.chunks_exact_mut(qs)).enumerate() {
                let r = first + i;
                let (qr, rest) = row.split_at_mut(qs);
                let (kr, vr) = rest.split_at_mut(kvs);
                let head_norm = s.qk_norm == Some(QkNorm::Head);
                if s.qk_norm == Some(QkNorm::Full) {
                    rms_norm_in_place(qr, layer.q_norm.as_deref().unwrap(), s.eps);
                    rms_norm_in_place(kr, layer.k_norm.as_deref().unwrap(), s.eps);
                }
                let norm_heads = |qr: &mut [f32], kr: &mut [f32]| {
                    qr.chunks_exact_mut(d).for_each(|h| rms_norm_in_place(h, layer.q_norm.as_deref().unwrap(), s.eps));
                    kr.chunks_exact_mut(d).for_each(|h| rms_norm_in_place(h, layer.k_norm.as_deref().unwrap(), s.eps));
                };
                if head_norm && !s.qk_norm_after_rope {
                    norm_heads(qr, kr);
                }
                if let Some(table) = table {
                    let pos = step.positions[r] as usize;
                    let cs = &table[pos * s.rotary_dim..][..s.rotary_dim];
                    qr.chunks_exact_mut(d).chain(kr.chunks_exact_mut(d)).for_each(|h| rotate(h, cs));
                }
                if head_norm && s.qk_norm_after_rope {
                    norm_heads(qr, kr);
                }
                qo.copy_from_slice(qr);
                let slot = step.slots[r] as usize;
                // SAFETY: slots are checked to lie in the caches, and a step's rows have distinct slots
                unsafe {
                    std::ptr::copy_nonoverlapping(kr.as_ptr(), kc.get().add(slot * kvs), kvs);
                    std::ptr::copy_nonoverlapping(vr.as_ptr(), vc.get().add(slot * kvs), kvs);
                }
            }
        };
        let t = step.ids.len();
        if t < PARALLEL_ROWS {
            work(0, qkv, q);
            return;
        }
        let per = t.div_ceil(2 * pool::threads()).max(4);
        let (qkv_ptr, q_ptr) = (SendPtr(qkv.as_mut_ptr()), SendPtr(q.as_mut_ptr()));
        pool::run(t.div_ceil(per), &|c| {
            let (a, b) = (c * per, ((c + 1) * per).min(t));
            // SAFETY: chunks of rows are disjoint
            let (rows, qo) = unsafe {
                (
                    std::slice::from_raw_parts_mut(qkv_ptr.get().add(a * width), (b - a) * width),
                    std::slice::from_raw_parts_mut(q_ptr.get().add(a * qs), (b - a) * qs),
                )
            };
            work(a, rows, qo);
        });
    }
}

fn check_len(what: &str, v: Option<&Vec<f32>>, n: usize) -> Result<(), String> {
    match v {
        Some(v) if v.len() != n => Err(format!("{what} has {} values, not {n}", v.len())),
        _ => Ok(()),
    }
}

fn check_expert(what: &str, e: &Expert, hidden: usize) -> Result<(), String> {
    if e.gate_up.cols != hidden || e.gate_up.rows % 2 != 0 || e.down.rows != hidden || e.down.cols * 2 != e.gate_up.rows {
        return Err(format!(
            "{what}: gate|up [{}, {}] and down [{}, {}] do not fit a hidden size of {hidden}",
            e.gate_up.rows, e.gate_up.cols, e.down.rows, e.down.cols
        ));
    }
    Ok(())
}


#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 2000) as f32 / 2000.0 - 0.5).collect()
    }

    fn dense(rows: usize, cols: usize, seed: u32) -> Linear {
        Linear::new(vec![Weight::Dense(Arc::new(DenseMatrix::new(rows, cols, &values(rows * cols, seed)).unwrap()))], None, false).unwrap()
    }

    fn borrowed(v: Vec<f32>) -> Borrowed {
        let mut v = v;
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        // SAFETY: the Vec's buffer does not move when the Vec moves into the box
        unsafe { Borrowed::new(ptr, len, Box::new(v)) }
    }

    /// A two-layer model: hidden 16, 4 heads of 8 over 2 KV heads, a vocabulary of 24, 8 blocks of 4.
    fn tiny() -> Decoder {
        let (hidden, heads, kv, d, vocab, inter) = (16, 4, 2, 8, 24, 32);
        let spec = Spec {
            hidden, heads, kv_heads: kv, head_dim: d, rotary_dim: d, eps: 1e-6, norms: Norms::Pre, norm_kind: NormKind::Rms, qk_norm: None,
            qk_norm_after_rope: false, activation: Activation::Silu, residual_multiplier: 1.0, embedding_multiplier: 1.0,
            logit_multiplier: 1.0, final_softcap: None,
        };
        let layers = (0..2)
            .map(|i| Layer {
                attn_norm: Some(vec![1.0; hidden]),
                mlp_norm: Some(vec![1.0; hidden]),
                attn_post_norm: None,
                mlp_post_norm: None,
                mixer: Mixer::Attention(Attention {
                    q_norm: None,
                    k_norm: None,
                    qkv: dense((heads + 2 * kv) * d, hidden, 10 + i),
                    o: dense(hidden, heads * d, 20 + i),
                    scores: Scores { scale: 0.35, window: if i == 0 { Some(3) } else { None }, softcap: None },
                    sinks: None,
                    rope: Some(0),
                }),
                mlp: Mlp::Dense(Expert { gate_up: dense(2 * inter, hidden, 30 + i), down: dense(hidden, inter, 40 + i) }),
            })
            .collect();
        let cache = || Cache { k: borrowed(vec![0.0; 8 * 4 * kv * d]), v: borrowed(vec![0.0; 8 * 4 * kv * d]) };
        Decoder::new(spec, Embedding::Dense(borrowed(values(vocab * hidden, 1))), layers, vec![1.0; hidden], dense(vocab, hidden, 2), vec![cache(), cache()], 8, 4)
            .unwrap()
    }

    fn rope() -> Vec<f32> {
        // [positions, 8]: cos in the first half, sin in the second
        (0..32).flat_map(|p| (0..4).map(move |i| (p as f32 * 0.1 * (i + 1) as f32).cos()).chain((0..4).map(move |i| (p as f32 * 0.1 * (i + 1) as f32).sin()))).collect()
    }

    /// Sequence A prefills 6 tokens in blocks [1, 2]; B decodes its token 2 in block [3]
    /// (its first two are cached by an earlier step). Returns the logits of A's last row and B's row.
    fn run(d: &Decoder, together: bool) -> Vec<f32> {
        let table = rope();
        let a = Step { ids: &[1, 5, 7, 2, 9, 4], positions: &[0, 1, 2, 3, 4, 5], slots: &[4, 5, 6, 7, 8, 9], tables: &[1, 2], max_blocks: 2, query_start: &[0, 6], logit_rows: &[5] };
        let b0 = Step { ids: &[3, 8], positions: &[0, 1], slots: &[12, 13], tables: &[3, 0], max_blocks: 2, query_start: &[0, 2], logit_rows: &[1] };
        let mut out = vec![0f32; d.vocab_size()];
        d.forward(&b0, &[&table], &mut out).unwrap();
        let mut logits = vec![0f32; 2 * d.vocab_size()];
        if together {
            let both = Step { ids: &[1, 5, 7, 2, 9, 4, 11], positions: &[0, 1, 2, 3, 4, 5, 2], slots: &[4, 5, 6, 7, 8, 9, 14], tables: &[1, 2, 3, 0], max_blocks: 2, query_start: &[0, 6, 7], logit_rows: &[5, 6] };
            d.forward(&both, &[&table], &mut logits).unwrap();
        } else {
            let b = Step { ids: &[11], positions: &[2], slots: &[14], tables: &[3, 0], max_blocks: 2, query_start: &[0, 1], logit_rows: &[0] };
            d.forward(&a, &[&table], &mut logits[..d.vocab_size()]).unwrap();
            d.forward(&b, &[&table], &mut logits[d.vocab_size()..]).unwrap();
        }
        logits
    }

    #[test]
    fn a_row_gives_the_same_logits_alone_and_in_a_mixed_step() {
        let alone = run(&tiny(), false);
        assert!(alone.iter().all(|v| v.is_finite()) && alone.iter().any(|&v| v != 0.0));
        assert_eq!(alone, run(&tiny(), true));
    }

    #[test]
    fn a_bad_step_is_refused_before_it_writes_anything() {
        let d = tiny();
        let table = rope();
        let mut out = vec![0f32; d.vocab_size()];
        let bad_block = Step { ids: &[1], positions: &[5], slots: &[4], tables: &[1, 9], max_blocks: 2, query_start: &[0, 1], logit_rows: &[0] };
        assert!(d.forward(&bad_block, &[&table], &mut out).unwrap_err().contains("block 9"));
        assert!(d.caches.iter().all(|c| c.k.slice().iter().all(|&v| v == 0.0)), "nothing written");
        let bad_id = Step { ids: &[99], positions: &[0], slots: &[4], tables: &[1, 2], max_blocks: 2, query_start: &[0, 1], logit_rows: &[0] };
        assert!(d.forward(&bad_id, &[&table], &mut out).unwrap_err().contains("token id 99"));
        let short_rope = Step { ids: &[1], positions: &[7], slots: &[4], tables: &[1, 2], max_blocks: 2, query_start: &[0, 1], logit_rows: &[0] };
        assert!(d.forward(&short_rope, &[&table[..8 * 4]], &mut out).unwrap_err().contains("rotary table"));
    }
}
