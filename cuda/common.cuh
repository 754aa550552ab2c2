// Shared by the kernels in this folder: element loads as float, and the
// counter-based random numbers the sampler draws (rust/cuda/reference.rs
// computes the same numbers on the CPU, so a seeded draw is reproducible
// there).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace guided {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// splitmix64's finaliser over (seed, step, token): one independent 64-bit
// value per draw, with no state to keep between steps.
__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

__device__ __forceinline__ uint64_t draw_bits(uint64_t seed, uint64_t step, uint32_t token) {
  return mix64(mix64(seed ^ mix64(step + 0x9e3779b97f4a7c15ULL)) + token);
}

// A uniform in (0, 1): the top 23 bits, offset by half a step, so that
// neither 0 nor 1 comes out and -log(-log(u)) is finite (k + 0.5 is exact
// in float for k < 2^23; with 24 bits the largest rounded up to 1, whose
// Gumbel is +inf). rust/sampling/random.rs defines the same stream for the CPU.
__device__ __forceinline__ float uniform_open(uint64_t bits) {
  return ((float)(bits >> 41) + 0.5f) * (1.0f / 8388608.0f);
}

__device__ __forceinline__ float gumbel(uint64_t seed, uint64_t step, uint32_t token) {
  return -logf(-logf(uniform_open(draw_bits(seed, step, token))));
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace guided
