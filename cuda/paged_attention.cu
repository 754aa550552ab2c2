// Decode attention over the paged KV cache, and the KV-cache write.
//
// The cache of one layer is a pair of [num_blocks, block_size, kv_heads,
// head_dim] tensors (python/guided/model/attention.py); a sequence's
// positions are found through its row of the block table. Prefill is not
// here: torch's SDPA (flash attention on CUDA) over the gathered blocks does
// it, as on the CPU, because a prefill chunk is compute-bound and SDPA is
// already at the hardware's peak there; decode is bandwidth-bound, reads
// every cached position once, and gathering first would read it twice.
//
// rust/cuda/reference.rs holds the same algorithm on the CPU, tested
// against torch; rust/cuda/launchers.rs launches these kernels.
#include "common.cuh"

namespace guided {

constexpr int WARPS = 4;

// One CTA per (head, sequence); each warp takes every WARPS-th position and
// keeps its own online softmax (running max, sum, weighted values), and the
// warps are merged at the end. Lane j holds elements j, j + 32, ... of the
// head (coalesced loads of one cached row per warp).
//
// What the new architectures ask of a layer's scores: a sliding window (only
// the last `window` positions; 0: all of them: Gemma, Mistral, gpt-oss), a
// soft-cap (softcap · tanh(s / softcap); 0: none: Gemma 2) and a per-head sink
// logit that joins the softmax and takes its share of the weight without a
// value (nullptr: none: gpt-oss).
template <typename T, int HEAD>
__device__ void decode(const T* __restrict__ q,            // [seqs, heads, HEAD]
                       const T* __restrict__ k_cache,      // [blocks, block_size, kv_heads, HEAD]
                       const T* __restrict__ v_cache,
                       const int32_t* __restrict__ block_tables,  // [seqs, max_blocks]
                       const int32_t* __restrict__ context_lens,  // [seqs]
                       T* __restrict__ out,                 // [seqs, heads, HEAD]
                       int heads, int kv_heads, int block_size, int max_blocks, float scale,
                       int window, float softcap, const float* __restrict__ sinks) {
  constexpr int PER_LANE = HEAD / 32;
  const int head = blockIdx.x, seq = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = head / (heads / kv_heads);
  const int len = context_lens[seq];
  const int32_t* table = block_tables + (size_t)seq * max_blocks;

  float qv[PER_LANE];
  const T* qrow = q + ((size_t)seq * heads + head) * HEAD;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) qv[i] = to_float(qrow[lane + 32 * i]) * scale;

  float m = -INFINITY, l = 0.f, acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;

  const int start = window > 0 && len > window ? len - window : 0;
  for (int pos = start + warp; pos < len; pos += WARPS) {
    const size_t row = ((size_t)table[pos / block_size] * block_size + pos % block_size) * kv_heads + kv_head;
    const T* krow = k_cache + row * HEAD;
    const T* vrow = v_cache + row * HEAD;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) dot += qv[i] * to_float(krow[lane + 32 * i]);
    float s = warp_sum(dot);
    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
    const float m_new = fmaxf(m, s);
    const float shrink = __expf(m - m_new), w = __expf(s - m_new);
    l = l * shrink + w;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] = acc[i] * shrink + w * to_float(vrow[lane + 32 * i]);
    m = m_new;
  }

  __shared__ float sm_m[WARPS], sm_l[WARPS], sm_acc[WARPS][HEAD];
  if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();

  const float sink = sinks == nullptr ? -INFINITY : sinks[head];
  float best = sink;
  for (int w = 0; w < WARPS; ++w) best = fmaxf(best, sm_m[w]);
  T* orow = out + ((size_t)seq * heads + head) * HEAD;
  for (int e = threadIdx.x; e < HEAD; e += blockDim.x) {
    float total = sink == -INFINITY ? 0.f : __expf(sink - best), sum = 0.f;
    for (int w = 0; w < WARPS; ++w) {
      if (sm_l[w] == 0.f) continue;  // a warp that saw no position
      const float f = __expf(sm_m[w] - best);
      total += f * sm_l[w];
      sum += f * sm_acc[w][e];
    }
    orow[e] = from_float<T>(total > 0.f ? sum / total : 0.f);
  }
}

// New tokens' K and V ([tokens, kv_heads, HEAD]) into their cache slots
// (block * block_size + offset); a negative slot is padding and skipped.
template <typename T>
__device__ void write_kv(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                         T* __restrict__ v_cache, const int64_t* __restrict__ slots, int row_elems) {
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;
  const T* ks = k + (size_t)blockIdx.x * row_elems;
  const T* vs = v + (size_t)blockIdx.x * row_elems;
  for (int e = threadIdx.x; e < row_elems; e += blockDim.x) {
    k_cache[slot * row_elems + e] = ks[e];
    v_cache[slot * row_elems + e] = vs[e];
  }
}

}  // namespace guided

#define DECODE(NAME, T, HEAD)                                                                      \
  extern "C" __global__ void __launch_bounds__(guided::WARPS * 32) NAME(                           \
      const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,                 \
      const int32_t* context_lens, T* out, int heads, int kv_heads, int block_size, int max_blocks, \
      float scale, int window, float softcap, const float* sinks) {                                \
    guided::decode<T, HEAD>(q, k_cache, v_cache, block_tables, context_lens, out, heads, kv_heads, \
                            block_size, max_blocks, scale, window, softcap, sinks);                \
  }

DECODE(guided_paged_decode_f32_h64, float, 64)
DECODE(guided_paged_decode_f32_h128, float, 128)
DECODE(guided_paged_decode_f16_h64, __half, 64)
DECODE(guided_paged_decode_f16_h128, __half, 128)
DECODE(guided_paged_decode_bf16_h64, __nv_bfloat16, 64)
DECODE(guided_paged_decode_bf16_h128, __nv_bfloat16, 128)
DECODE(guided_paged_decode_f32_h256, float, 256)
DECODE(guided_paged_decode_f16_h256, __half, 256)
DECODE(guided_paged_decode_bf16_h256, __nv_bfloat16, 256)

#define WRITE_KV(NAME, T)                                                                         \
  extern "C" __global__ void NAME(const T* k, const T* v, T* k_cache, T* v_cache,                 \
                                  const int64_t* slots, int row_elems) {                          \
    guided::write_kv<T>(k, v, k_cache, v_cache, slots, row_elems);                                \
  }

WRITE_KV(guided_write_kv_f32, float)
WRITE_KV(guided_write_kv_f16, __half)
WRITE_KV(guided_write_kv_bf16, __nv_bfloat16)
