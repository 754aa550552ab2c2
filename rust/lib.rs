//! Native core of guided: everything that runs once per token for every
//! sequence. Pure Rust; the PyO3 layer in `python.rs` only translates.

pub mod activations;
pub mod attention;
pub mod block_manager;
pub mod closing;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod cuda_reference;
pub mod decoder;
pub mod dense;
pub mod device_sampling;
pub mod grammar;
pub mod layer_ops;
pub mod masks;
pub mod moe;
pub mod packed;
pub mod pool;
pub mod quant;
pub mod random;
pub mod sampling;
pub mod scheduler;
pub mod scheduler_counters;
pub mod speculative;
pub mod step_profile;
pub mod sequence;
pub mod short_conv;
pub mod simd;

#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_attention;
#[cfg(feature = "python")]
mod python_cuda;
#[cfg(feature = "python")]
mod python_decoder;
#[cfg(feature = "python")]
mod python_grammar;
#[cfg(feature = "python")]
mod python_plan;
#[cfg(feature = "python")]
mod python_quant;
