//! The CUDA side: the launchers of the `cuda/` kernels (`launchers.rs`, the
//! `cuda` feature), their algorithms on the CPU (`reference.rs`), and one
//! step's rows as the device sampler reads them (`device_sampling.rs`).
//! Imports `cpu` and `sampling`.

pub mod device_sampling;
#[cfg(feature = "cuda")]
pub mod launchers;
pub mod reference;
