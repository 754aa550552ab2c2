//! Native core of guided: everything that runs once per token for every
//! sequence. Pure Rust; the PyO3 layer in `bindings/` only translates.
//!
//! The folders are layers; each imports only those below it
//! (`tests/test_structure.py` checks it):
//!
//! - [`cpu`]: the native CPU step and its kernels; imports nothing else.
//! - [`sampling`]: the seeded random stream and the CPU sampler; imports nothing else.
//! - [`grammar`]: llguidance's matchers and the closing search; imports nothing else.
//! - [`cuda`]: the CUDA kernels' launchers, their CPU references, the device
//!   sampler's rows; imports `cpu` and `sampling`.
//! - [`engine`]: the scheduler and what it schedules; imports `grammar`,
//!   `sampling` and `cuda`.
//! - `bindings` (the `python` feature): PyO3 translation of all of the above;
//!   nothing else names it.

pub mod cpu;
pub mod cuda;
pub mod engine;
pub mod grammar;
pub mod sampling;
pub mod threads;

#[cfg(feature = "python")]
mod bindings;
