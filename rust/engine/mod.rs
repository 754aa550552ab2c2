//! The engine: continuous batching (`scheduler.rs`), the sequences it
//! schedules, their KV blocks and prefix cache, a step's grammar masks and
//! speculative drafts. Imports `grammar`, `sampling` and `cuda`.

pub mod block_manager;
pub mod masks;
pub mod scheduler;
pub mod scheduler_counters;
pub mod sequence;
pub mod speculative;
