// WGMMA batches of the Hopper decode kernel: a warpgroup's k-steps of
// C (+)= A B over CuTe fragments (MMA, 1, k-steps), as every GEMM of the
// consumers issues them.
#pragma once

#include <cute/tensor.hpp>

namespace jax_flash_mla::sm90 {

// k-steps [k_first, k_first + kSteps) into the open batch (kSteps 0: all of
// A's). scale-d is 0 on the first step unless `accumulate`: D = A B, the old
// accumulator is not read (so it needs no clearing).
template <int kSteps = 0, class Mma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void wgmma_k_steps(Mma& mma, const FragA& a, const FragB& b, FragC& c, bool accumulate,
                                              int k_first = 0) {
  constexpr int kCount = kSteps ? kSteps : int(decltype(cute::size<2>(a))::value);
  mma.accumulate_ = accumulate ? cute::GMMA::ScaleOut::One : cute::GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < kCount; ++k) {
    cute::gemm(mma, a(cute::_, cute::_, k_first + k), b(cute::_, cute::_, k_first + k), c);
    mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
}

// One committed batch of those k-steps: C is fenced (its registers stay put
// across the asynchronous WGMMAs) and the warpgroup arrives first.
template <int kSteps = 0, class Mma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void wgmma_batch(Mma& mma, const FragA& a, const FragB& b, FragC& c, bool accumulate,
                                            int k_first = 0) {
  cute::warpgroup_fence_operand(c);
  cute::warpgroup_arrive();
  wgmma_k_steps<kSteps>(mma, a, b, c, accumulate, k_first);
  cute::warpgroup_commit_batch();
}

}  // namespace jax_flash_mla::sm90
