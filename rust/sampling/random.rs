//! The one seeded random stream both samplers draw from.
//!
//! Every random number a sampler uses is `uniform(seed, step, token)`: a
//! counter-based hash of the sequence's seed, the draw's number in that
//! sequence (`step`) and a token id, so it needs no state beyond (seed,
//! step) and every token of a draw gets its own number in parallel. The CPU
//! sampler (`cpu_sampler.rs`) and the CUDA sampler (`cuda/sampling.cu`, pass for
//! pass in `cuda/reference.rs`) both draw by Gumbel-max over the tokens they
//! keep: the kept token with the largest `s_i + gumbel(seed, step, i)`, where
//! `s_i` is the scaled logit. So a seeded request draws the same tokens on
//! the CPU and on a GPU, up to a tie in the last bit of an `exp` or `ln`.

/// The splitmix64 finaliser: a bijection of u64 whose every output bit
/// depends on every input bit.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A uniform in (0, 1) for (seed, step, token): 23 random bits, centred in
/// their interval so that neither 0 nor 1 comes out (`k + 0.5` is exact in
/// f32 for k < 2^23; with 24 bits the largest rounds up to 1.0, whose
/// Gumbel is +inf, and that token would win whatever its logit).
pub fn uniform(seed: u64, step: u64, token: u32) -> f32 {
    let bits = mix64(mix64(seed ^ mix64(step.wrapping_add(0x9e37_79b9_7f4a_7c15))).wrapping_add(u64::from(token)));
    ((bits >> 41) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// A standard Gumbel variate for (seed, step, token).
pub fn gumbel(seed: u64, step: u64, token: u32) -> f32 {
    -(-uniform(seed, step, token).ln()).ln()
}

/// No [`gumbel`] is larger than this (its value at the largest uniform), so
/// a token whose scaled logit plus this cannot beat the best key so far can
/// be skipped without hashing it.
pub fn gumbel_bound() -> f32 {
    -(-(((1u32 << 23) as f32 - 0.5) * (1.0 / 8_388_608.0)).ln()).ln()
}

/// One sequence's stream: its seed, and how many draws it has made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    pub seed: u64,
    pub step: u64,
}

impl Stream {
    /// The stream of `seed`, or of a seed from the OS when none is given.
    pub fn new(seed: Option<u64>) -> Self {
        let seed = seed.unwrap_or_else(|| {
            use std::hash::{BuildHasher, RandomState};
            RandomState::new().hash_one(std::time::SystemTime::now())
        });
        Stream { seed, step: 0 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniforms_are_inside_the_unit_interval_and_spread() {
        let u: Vec<f32> = (0..100_000).map(|t| uniform(7, 3, t)).collect();
        assert!(u.iter().all(|&v| v > 0.0 && v < 1.0));
        let mean = u.iter().map(|&v| f64::from(v)).sum::<f64>() / u.len() as f64;
        assert!((mean - 0.5).abs() < 0.005, "{mean}");
        // each tenth holds about a tenth
        let mut tenths = [0usize; 10];
        u.iter().for_each(|&v| tenths[(v * 10.0) as usize] += 1);
        assert!(tenths.iter().all(|&n| (9_500..10_500).contains(&n)), "{tenths:?}");
    }

    #[test]
    fn the_bound_is_the_largest_gumbel() {
        let bound = gumbel_bound();
        assert!(bound.is_finite());
        assert!((0..200_000).all(|t| gumbel(1, 2, t) <= bound));
        assert!(bound > 16.0 && bound < 18.0, "{bound}");
    }

    #[test]
    fn streams_differ_by_seed_and_step() {
        assert_ne!(uniform(1, 0, 5), uniform(2, 0, 5));
        assert_ne!(uniform(1, 0, 5), uniform(1, 1, 5));
        assert_eq!(uniform(1, 4, 5), uniform(1, 4, 5));
        assert_ne!(Stream::new(None).seed, Stream::new(None).seed);
    }
}
