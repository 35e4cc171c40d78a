// Online softmax of the decode kernel, fp32, in the log2 domain.
//
// Every consumer thread holds two query rows of a WGMMA accumulator tile:
// the m64nNk16 fragment gives thread t of a warpgroup rows 16*(t/32) + (t%32)/4
// and that + 8, and N/4 columns of each (PTX ISA "Matrix fragments for
// wgmma.mma_async ... D"). Value v of the fragment belongs to row half
// (v >> 1) & 1, so a row is spread over the 4 threads of a quad: row
// reductions are a per-thread pairwise tree plus two xor-shuffles.
//
// Numerics: scores stay in raw q.k units; exp(scale * (s - m)) is computed as
// exp2(s * scale_log2 - m * scale_log2) with one FFMA + EX2 (exp2_ftz). A row
// that has seen no key keeps m = -inf; its exponent base is taken as 0 so
// masked scores (-inf) give exp2(-inf) = 0 instead of NaN.
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

// 2^x on the SFU alone (ex2.approx.ftz). exp2f without --use_fast_math wraps
// the same EX2 in a range test and two predicated multiplies, to return
// subnormal results below 2^-126, which no caller needs: such a probability
// is 0 in e4m3 and below every fp32 row sum it joins (a row's sum is >= 1),
// and such a rescale factor leaves less than 2^-126 of what it scales.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x on the SFU alone (rcp.approx.ftz): exact for powers of two (fp8_ds_mla's
// group normalizers from our quantizer; other scales round within 1 ulp),
// without __fdividef's guard for divisors near the top of the range.
__device__ __forceinline__ float rcp_ftz(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Reduces one row half of a fragment (values v with fragment_row_half(v) == h)
// by `op` as a pairwise tree: log2(N/2) dependent steps instead of N/2, which
// matters for the softmax's latency-bound chains (the compiler keeps the order
// it is given for floats).
template <class Frag, class Op>
__device__ __forceinline__ float row_half_tree(const Frag& s, int h, Op op) {
  constexpr int kHalf = decltype(cute::size(s))::value / 2;
  static_assert((kHalf & (kHalf - 1)) == 0, "a power of two per row half");
  float x[kHalf];
  CUTE_UNROLL
  for (int i = 0; i < kHalf; ++i) x[i] = s(4 * (i / 2) + 2 * h + i % 2);  // the half's i-th value
  CUTE_UNROLL
  for (int stride = 1; stride < kHalf; stride *= 2) {
    CUTE_UNROLL
    for (int i = 0; i + stride < kHalf; i += 2 * stride) x[i] = op(x[i], x[i + stride]);
  }
  return x[0];
}

// Row maxima of a score fragment over this quad's columns (both row halves).
template <class Frag>
__device__ __forceinline__ void row_max(const Frag& s, float (&m)[2]) {
  auto max_op = [](float a, float b) { return fmaxf(a, b); };
  m[0] = quad_allreduce_max(row_half_tree(s, 0, max_op));
  m[1] = quad_allreduce_max(row_half_tree(s, 1, max_op));
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
  const float o_scale = new_max == -INFINITY ? 1.f : exp2_ftz((ref - new_max) * scale_log2);
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
    for (int v = 0; v < cute::size(s); ++v) s(v) = exp2_ftz(fmaf(s(v), scale_log2, -base[fragment_row_half(v)]));
    auto add_op = [](float a, float b) { return a + b; };
    sum[0] += row_half_tree(s, 0, add_op);
    sum[1] += row_half_tree(s, 1, add_op);
  }
};

}  // namespace jax_flash_mla::sm90
