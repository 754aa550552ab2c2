//! The threads the step's short parallel loops run on (`pool.rs`): the CPU
//! kernels, the sampler's rows and the on-demand grammar masks share them, so
//! each loop starts on threads still spinning from the last. Imports nothing
//! of the other folders.

pub mod pool;
