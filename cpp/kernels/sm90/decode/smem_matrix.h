// Warp-wide store of four 8x8 b16 matrices to shared memory (PTX ISA
// "stmatrix"): lane i gives the 32-bit shared address of row i % 8 of matrix
// i / 8, and register j of every lane holds its two b16 of matrix j (row
// lane / 4, columns 2 (lane % 4) + {0, 1}). The two ldmatrix.trans loads stay
// inline asm at their sites: the same asm through a helper changed
// fp8_ds_mla's SASS (session 22), which no GPU run has measured.
#pragma once

#include <cstdint>

namespace jax_flash_mla::sm90 {

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}

}  // namespace jax_flash_mla::sm90
