// Online softmax of the decode kernel, fp32, in the log2 domain.
//
// Every consumer thread holds two query rows of a WGMMA accumulator tile:
// the m64nNk16 fragment gives thread t of a warpgroup rows 16*(t/32) + (t%32)/4
// and that + 8, and N/4 columns of each (PTX ISA "Matrix fragments for
// wgmma.mma_async ... D"). Value v of the fragment belongs to row half
// (v >> 1) & 1, so a row is spread over the 4 threads of a quad: row
// reductions are a per-thread pass plus two xor-shuffles.
//
// Numerics: scores stay in raw q.k units; exp(scale * (s - m)) is computed as
// exp2(s * scale_log2 - m * scale_log2) with one FFMA + EX2. A row that has
// seen no key keeps m = -inf; its exponent base is taken as 0 so masked
// scores (-inf) give exp2(-inf) = 0 instead of NaN.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

namespace jax_flash_mla::sm90 {

__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ int fragment_row_half(int v) { return (v >> 1) & 1; }

// Row maxima of a score fragment over this quad's columns (both row halves).
template <class Frag>
__device__ __forceinline__ void row_max(const Frag& s, float (&m)[2]) {
  m[0] = m[1] = -INFINITY;
  CUTE_UNROLL
  for (int v = 0; v < cute::size(s); ++v) {
    const int h = fragment_row_half(v);
    m[h] = fmaxf(m[h], s(v));
  }
  m[0] = quad_allreduce_max(m[0]);
  m[1] = quad_allreduce_max(m[1]);
}

// Moves a running reference maximum `ref` (raw-score units, -inf until a
// visible key was seen) for a page whose maximum is `page_max`; returns the
// factor by which what was accumulated against the old reference shrinks and
// sets `base`, the new reference in exp2 units (p = exp2(s * scale_log2 - base)).
// kLazyRescaleLog2 > 0: the reference moves only when the page's maximum
// exceeds it by more than 2^kLazyRescaleLog2 in exp2 units, so
// p <= 2^kLazyRescaleLog2 and the rescale of the output accumulator becomes
// rare. lse and the output are exact either way: they use the same reference.
template <int kLazyRescaleLog2>
__device__ __forceinline__ float move_reference(float& ref, float page_max, float scale_log2, float& base) {
  float new_max = fmaxf(ref, page_max);
  // (From -inf the difference is +inf: the first key always sets it.)
  if (kLazyRescaleLog2 > 0 && (new_max - ref) * scale_log2 <= float(kLazyRescaleLog2)) new_max = ref;
  // exp2(-inf) = 0 when the old max was -inf (the accumulator is still 0).
  const float o_scale = new_max == -INFINITY ? 1.f : exp2f((ref - new_max) * scale_log2);
  base = new_max == -INFINITY ? 0.f : new_max * scale_log2;
  ref = new_max;
  return o_scale;
}

// Running statistics of the two rows a thread holds. `sum` is this thread's
// partial (its own columns only); it is reduced across the quad, and across
// warpgroups, once at the end of a chunk.
struct OnlineSoftmaxState {
  float max[2];  // raw-score units; -inf until a visible key was seen
  float sum[2];

  __device__ __forceinline__ void reset() {
    max[0] = max[1] = -INFINITY;
    sum[0] = sum[1] = 0.f;
  }

  // Folds in a page whose row maxima (over all its visible keys, both
  // warpgroups) are `page_max`. Turns `s` into probabilities in place and
  // returns the factor by which the existing output accumulator must shrink
  // (move_reference; with the lazy rule the O / row-sum rescale, 128
  // multiplies per thread, becomes rare). Each format picks the headroom its
  // P type has (Traits::kLazyRescaleLog2).
  template <int kLazyRescaleLog2 = 0, class Frag>
  __device__ __forceinline__ void update(Frag& s, const float (&page_max)[2], float scale_log2,
                                         float (&o_scale)[2]) {
    float base[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      o_scale[h] = move_reference<kLazyRescaleLog2>(max[h], page_max[h], scale_log2, base[h]);
      sum[h] *= o_scale[h];
    }
    CUTE_UNROLL
    for (int v = 0; v < cute::size(s); ++v) {
      const int h = fragment_row_half(v);
      const float p = exp2f(fmaf(s(v), scale_log2, -base[h]));
      s(v) = p;
      sum[h] += p;
    }
  }
};

}  // namespace jax_flash_mla::sm90
