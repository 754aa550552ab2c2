// Mask-fused sampling: logits [rows, vocab] (float32) and the grammar's
// packed bitmask [rows, words] (bit j of word i allows token 32 i + j;
// tokens past the last word are not allowed; the CPU sampler's format,
// rust/sampling/cpu_sampler.rs) → one token id and its log-probability per row. The
// mask is applied as the logits are read: no masked copy of the logits is
// ever written.
//
// Per row (one CTA of 1024 threads), in passes over the vocabulary:
//   1. the best allowed logit m and its first index (greedy stops here,
//      after one more pass for the log-normaliser);
//   2. top-k, then top-p over the top-k's mass: each a two-level histogram
//      search over the scaled logits s = (x - m) / T ≤ 0 (2048 bins over
//      [-88, 0], then 2048 sub-bins of the bin where the cut falls), so a
//      cut costs two passes and no sort; tokens within one sub-bin
//      (2.1e-5 of scaled logit) of the cut are kept together. Masses are
//      summed in 32.32 fixed point, so the cut does not depend on the
//      order of the threads' additions and seeded draws repeat;
//   3. min-p as a floor on s (p_i ≥ min_p · p_max ⇔ s_i ≥ ln min_p);
//   4. the draw: Gumbel-max over the kept tokens, argmax of s_i + g_i with
//      g_i = -log(-log(u_i)) and u_i a hash of (seed, step, token), which
//      draws token i with probability exp(s_i) / Σ_kept exp(s_j) exactly,
//      with the kept mass for the log-probability in the same pass.
// Penalties, logit bias and banned tokens are applied before, in place, by
// guided_adjust_logits (a few entries per row, not a pass over the row).
//
// rust/cuda/reference.rs runs the same passes on the CPU (tested against
// torch); rust/cuda/launchers.rs launches these kernels.
#include "common.cuh"

namespace guided {

constexpr int THREADS = 1024;
constexpr int BINS = 2048;
constexpr float SPAN = 88.f;  // below -87 a weight exp(s) is 0 in float32
constexpr float MASS_ONE = 4294967296.f;  // 2^32: fixed-point unit of mass

__device__ __forceinline__ bool allowed(const uint32_t* mask, int words, int i) {
  if (mask == nullptr) return true;
  const int w = i >> 5;
  return w < words && ((mask[w] >> (i & 31)) & 1u);
}

// NaN is never drawn; +inf is the largest float (rust/sampling/cpu_sampler.rs sanitize).
__device__ __forceinline__ float clean(float x) {
  return isnan(x) ? -INFINITY : (x == INFINITY ? 3.402823466e38f : x);
}

__device__ __forceinline__ int bin_of(float s) {
  const float b = -s * (BINS / SPAN);
  return b < (float)(BINS - 1) ? (int)fmaxf(b, 0.f) : BINS - 1;
}

__device__ __forceinline__ int sub_of(float s, int bin) {
  const float width = SPAN / BINS;
  const float b = (-s - bin * width) * (BINS / width);
  return b < (float)(BINS - 1) ? (int)fmaxf(b, 0.f) : BINS - 1;
}

__device__ __forceinline__ unsigned long long fixed_mass(float s) {
  return (unsigned long long)(expf(s) * MASS_ONE);
}

// A cut keeps the tokens whose (bin, sub-bin) is at or before (bin, sub).
struct Cut {
  int bin, sub;
};
constexpr Cut KEEP_ALL = {BINS, 0};

__device__ __forceinline__ bool kept(float s, Cut c) {
  const int b = bin_of(s);
  return b < c.bin || (b == c.bin && sub_of(s, b) <= c.sub);
}

struct Row {
  const float* x;
  const uint32_t* mask;
  int vocab, words;
  float m, inv_t;
};

__device__ __forceinline__ float scaled(const Row& r, int i) { return (clean(r.x[i]) - r.m) * r.inv_t; }

__shared__ unsigned int s_count[BINS];
__shared__ unsigned long long s_mass[BINS];
// what the scanning thread hands to the others
__shared__ int s_found;
__shared__ unsigned long long s_above_count, s_above_mass, s_need;

// The first (sub-)bin at which the running count reaches `count` or the
// running mass reaches `mass`, scanning from the best; -1 if neither is
// reached. One thread scans (2048 steps).
__device__ int scan(unsigned long long count, unsigned long long mass) {
  unsigned long long c = s_above_count, w = s_above_mass;
  for (int b = 0; b < BINS; ++b) {
    c += s_count[b];
    w += s_mass[b];
    if (c >= count || w >= mass) return b;
  }
  return -1;
}

__device__ void clear_bins() {
  for (int b = threadIdx.x; b < BINS; b += THREADS) { s_count[b] = 0; s_mass[b] = 0; }
  __syncthreads();
}

__device__ __forceinline__ void add_to_bin(int b, float s) {
  atomicAdd(&s_count[b], 1u);
  atomicAdd(&s_mass[b], fixed_mass(s));
}

// The cut within `within` that keeps its first `count` tokens, or the
// first `fraction` of its mass; `within` itself where that is everything.
__device__ Cut search(const Row& r, Cut within, unsigned long long count, float fraction) {
  // level 1: the bin where the cut falls
  clear_bins();
  for (int i = threadIdx.x; i < r.vocab; i += THREADS) {
    if (!allowed(r.mask, r.words, i)) continue;
    const float s = scaled(r, i);
    if (s != -INFINITY && kept(s, within)) add_to_bin(bin_of(s), s);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int b = 0; b < BINS; ++b) total += s_mass[b];
    s_need = fraction < 1.f ? (unsigned long long)((double)fraction * (double)total) : ~0ull;
    s_above_count = s_above_mass = 0;
    s_found = scan(count, s_need);
    for (int b = 0; b < s_found; ++b) { s_above_count += s_count[b]; s_above_mass += s_mass[b]; }
  }
  __syncthreads();
  const int bin = s_found;
  if (bin < 0) return within;
  // level 2: the sub-bin of that bin
  clear_bins();
  for (int i = threadIdx.x; i < r.vocab; i += THREADS) {
    if (!allowed(r.mask, r.words, i)) continue;
    const float s = scaled(r, i);
    if (s != -INFINITY && bin_of(s) == bin && kept(s, within)) add_to_bin(sub_of(s, bin), s);
  }
  __syncthreads();
  if (threadIdx.x == 0) s_found = scan(count, s_need);
  __syncthreads();
  const int sub = s_found;
  __syncthreads();
  return sub < 0 ? within : Cut{bin, sub};
}

// Block-wide (value, index) argmax, the lowest index on ties.
__device__ void best_of(float& v, int& i) {
  __shared__ float sv[THREADS / 32];
  __shared__ int si[THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  if (warp == 0) {
    v = lane < THREADS / 32 ? sv[lane] : -INFINITY;
    i = lane < THREADS / 32 ? si[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, v, o);
      const int oi = __shfl_xor_sync(0xffffffffu, i, o);
      if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    if (lane == 0) { sv[0] = v; si[0] = i; }
  }
  __syncthreads();
  v = sv[0];
  i = si[0];
  __syncthreads();
}

__device__ float block_sum(float v) {
  __shared__ float part[THREADS / 32];
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) total += part[w];
  __syncthreads();
  return total;
}

}  // namespace guided

using namespace guided;

extern "C" __global__ void __launch_bounds__(THREADS) guided_masked_sample(
    const float* __restrict__ logits, const uint32_t* __restrict__ mask, int vocab, int words,
    const float* __restrict__ temperature, const int32_t* __restrict__ top_k,
    const float* __restrict__ top_p, const float* __restrict__ min_p,
    const unsigned long long* __restrict__ seeds, const unsigned long long* __restrict__ steps,
    long long* __restrict__ tokens, float* __restrict__ logprobs) {
  const int row = blockIdx.x;
  Row r{logits + (size_t)row * vocab, mask == nullptr ? nullptr : mask + (size_t)row * words, vocab,
        words, 0.f, 1.f};

  // 1. the best allowed logit, its first index
  float best = -INFINITY;
  int at = 0x7fffffff;
  for (int i = threadIdx.x; i < vocab; i += THREADS) {
    if (!allowed(r.mask, words, i)) continue;
    const float v = clean(r.x[i]);
    if (v > best) { best = v; at = i; }  // each thread walks up: its first max
  }
  best_of(best, at);
  if (best == -INFINITY) {
    if (threadIdx.x == 0) { tokens[row] = -1; logprobs[row] = -INFINITY; }
    return;
  }
  r.m = best;
  const float t = temperature[row];
  if (t == 0.f) {
    float z = 0.f;
    for (int i = threadIdx.x; i < vocab; i += THREADS)
      if (allowed(r.mask, words, i)) z += expf(clean(r.x[i]) - best);
    z = block_sum(z);
    if (threadIdx.x == 0) { tokens[row] = at; logprobs[row] = -logf(z); }
    return;
  }
  r.inv_t = 1.f / t;

  // 2. top-k, then top-p within it
  Cut cut = KEEP_ALL;
  if (top_k[row] > 0) cut = search(r, cut, (unsigned long long)top_k[row], 1.f);
  if (top_p[row] < 1.f) cut = search(r, cut, ~0ull, top_p[row]);
  // 3. min-p
  const float floor = min_p[row] > 0.f ? logf(min_p[row]) : -INFINITY;

  // 4. Gumbel-max over what is kept, and the kept mass
  float key = -INFINITY, mass = 0.f;
  int pick = 0x7fffffff;
  const unsigned long long seed = seeds[row], step = steps[row];
  for (int i = threadIdx.x; i < vocab; i += THREADS) {
    if (!allowed(r.mask, words, i)) continue;
    const float s = scaled(r, i);
    if (s == -INFINITY || s < floor || !kept(s, cut)) continue;
    mass += expf(s);
    const float k = s + gumbel(seed, step, (uint32_t)i);
    if (k > key) { key = k; pick = i; }
  }
  mass = block_sum(mass);
  best_of(key, pick);
  if (threadIdx.x == 0) {
    tokens[row] = pick;
    logprobs[row] = scaled(r, pick) - logf(mass);
  }
}

// Penalties, logit bias and banned tokens, in place, for the few tokens a
// row names: one entry per distinct (row, token) seen in the prompt or
// output, or biased. In the CPU sampler's order: repetition penalty (HF:
// divide a positive logit, multiply a negative one), then frequency and
// presence (output occurrences only), then the bias (-inf bans).
extern "C" __global__ void guided_adjust_logits(
    float* __restrict__ logits, int vocab, int entries, const int32_t* __restrict__ rows,
    const int32_t* __restrict__ tokens, const int32_t* __restrict__ seen,
    const int32_t* __restrict__ counts, const float* __restrict__ bias,
    const float* __restrict__ repetition, const float* __restrict__ frequency,
    const float* __restrict__ presence) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= entries) return;
  const int row = rows[e];
  float* x = logits + (size_t)row * vocab + tokens[e];
  float v = clean(*x);
  if (seen[e]) {
    const float rp = repetition[row];
    v = v > 0.f ? v / rp : v * rp;
  }
  if (counts[e] > 0) v -= frequency[row] * counts[e] + presence[row];
  *x = v + bias[e];
}
