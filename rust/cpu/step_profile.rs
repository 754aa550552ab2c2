//! Where the CPU step's time goes (`Decoder::profile`): its phases, and the
//! seconds each took over the steps since profiling started.

/// Where a step's time goes, when profiling (`Decoder::profile`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Embed,
    /// input norms, post norms and residual adds
    Norms,
    /// activations quantized to 8 bits for the packed kernels
    Quantize,
    /// q|k|v (a convolution layer's in_proj)
    Qkv,
    /// q/k norms, rotation and the KV write
    Rope,
    /// attention (a convolution layer's mixing)
    Attention,
    /// o (a convolution layer's out_proj)
    Output,
    GateUp,
    Activation,
    Down,
    /// routing and gathering rows for experts
    Experts,
    Head,
}

pub const PHASES: [Phase; 12] = [
    Phase::Embed,
    Phase::Norms,
    Phase::Quantize,
    Phase::Qkv,
    Phase::Rope,
    Phase::Attention,
    Phase::Output,
    Phase::GateUp,
    Phase::Activation,
    Phase::Down,
    Phase::Experts,
    Phase::Head,
];

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Embed => "embed",
            Phase::Norms => "norms_residual",
            Phase::Quantize => "quantize_activations",
            Phase::Qkv => "qkv_matmul",
            Phase::Rope => "qk_norm_rope_kv_write",
            Phase::Attention => "attention",
            Phase::Output => "o_matmul",
            Phase::GateUp => "gate_up_matmul",
            Phase::Activation => "activation",
            Phase::Down => "down_matmul",
            Phase::Experts => "expert_routing",
            Phase::Head => "lm_head",
        }
    }
}

/// Time per phase, summed over the steps since profiling started.
#[derive(Default, Clone)]
pub struct Profile {
    pub steps: usize,
    pub rows: usize,
    pub seconds: [f64; PHASES.len()],
    pub total: f64,
}
