//! What the scheduler counts, for the engine's stats and a dashboard.

use crate::engine::speculative::DraftCounters;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub prefix_cache_hit_tokens: usize,
    pub prefix_cache_queries: usize,
    /// Prompt tokens the KV cache held past the hit a recurrent model's state snapshots allowed
    /// (`Scheduler::limit_prefix`): recomputed for want of the state there.
    pub prefix_cache_state_miss_tokens: usize,
    pub preemptions: usize,
    /// Tokens appended by fast-forward, without sampling.
    pub forced_tokens: usize,
    /// Wall time of the mask jobs, and how much of it sample() waited for:
    /// the difference was hidden behind the forward pass.
    pub mask_time_us: u64,
    pub mask_wait_us: u64,
    /// Row masks computed.
    pub mask_rows: usize,
    /// Rows drawn without their mask and checked after (masks.rs,
    /// `MaskPolicy::OnDemand`), and those of them whose token the grammar
    /// refused (their mask then computed and the row drawn again).
    pub mask_rows_on_demand: usize,
    pub mask_rows_refused: usize,
    pub drafts: DraftCounters,
}

impl Counters {
    /// The counters by name (the drafts' among them).
    pub fn entries(&self) -> Vec<(&'static str, usize)> {
        let mut out = vec![
            ("prefix_cache_hit_tokens", self.prefix_cache_hit_tokens),
            ("prefix_cache_queries", self.prefix_cache_queries),
            ("prefix_cache_state_miss_tokens", self.prefix_cache_state_miss_tokens),
            ("preemptions", self.preemptions),
            ("forced_tokens", self.forced_tokens),
            ("mask_time_us", self.mask_time_us as usize),
            ("mask_wait_us", self.mask_wait_us as usize),
            ("mask_rows", self.mask_rows),
            ("mask_rows_on_demand", self.mask_rows_on_demand),
            ("mask_rows_refused", self.mask_rows_refused),
        ];
        out.extend(self.drafts.entries());
        out
    }
}
