//! The native CPU step (`native_step.rs`: a whole step of a model in one
//! call) and its kernels. Imports only the thread pool (threads/).

pub mod activations;
pub mod cpu_attention;
pub mod dense;
pub mod expert_routing;
pub mod gated_conv;
pub mod layer_ops;
pub mod native_step;
pub mod packed;
mod packed_kernels;
mod packed_layout;
pub mod quant;
pub mod simd;
pub mod step_profile;
