//! Grammars: llguidance's compiler and matchers (`matchers.rs`) and the
//! closing search (`closing.rs`). Imports nothing of the other folders.

pub mod closing;
pub mod matchers;
