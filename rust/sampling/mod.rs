//! Sampling on the host: the one seeded random stream both samplers draw
//! from (`random.rs`) and the CPU sampler (`cpu_sampler.rs`; the GPU's is
//! `cuda/sampling.cu`). Imports only the thread pool (threads/), whose
//! threads draw the rows.

pub mod cpu_sampler;
pub mod random;
