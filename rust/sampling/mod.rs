//! Sampling on the host: the one seeded random stream both samplers draw
//! from (`random.rs`) and the CPU sampler (`cpu_sampler.rs`; the GPU's is
//! `cuda/sampling.cu`). Imports nothing of the other folders.

pub mod cpu_sampler;
pub mod random;
