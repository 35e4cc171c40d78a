// MLA decode constants shared by every kernel, launcher and FFI handler.
#pragma once

namespace jax_flash_mla::config {

// Latent layout of DeepSeek-V2/V3 MLA: q and the cached latent are 576 wide;
// the first 512 ("NoPE") channels double as V, the last 64 carry RoPE.
inline constexpr int kHeadDimQK = 576;
inline constexpr int kHeadDimV = 512;
inline constexpr int kHeadDimRope = kHeadDimQK - kHeadDimV;

// Paged KV cache: one page holds this many tokens (FlashMLA's page size).
inline constexpr int kPageSize = 64;

// Query rows (s_q x heads-per-KV-head) handled by one CTA: one WGMMA M tile.
inline constexpr int kRowsPerTile = 64;

// fp8_ds_mla: one fp32 scale per 128 NoPE channels; 656 bytes per token.
inline constexpr int kQuantTile = 128;
inline constexpr int kNumScales = kHeadDimV / kQuantTile;  // 4
inline constexpr int kDsMlaBytesPerToken =
    kHeadDimV /*e4m3*/ + kNumScales * 4 /*fp32*/ + kHeadDimRope * 2 /*bf16*/;
static_assert(kDsMlaBytesPerToken == 656);

// The three cache formats; each has a traits struct in the decode kernel. kFp8DsMlaTokenScales is not a format of
// its own: fp8_ds_mla's bytes as design S on the page pairs reads them, fast on caches with one scale per token
// (docs/DESIGN.md, "Design S on the page pairs: the build").
enum class KvFormat { kBf16, kFp8PerTensor, kFp8DsMla, kFp8DsMlaTokenScales };

// Scheduler: a sequence costs ceil(len / kPageSize) pages plus this fixed
// overhead (its epilogue / combine share), so short sequences still spread out.
inline constexpr int kSchedFixedOverheadPages = 5;
// Ints per partition in the scheduler metadata (padded to 32 bytes).
inline constexpr int kSchedMetaInts = 8;

}  // namespace jax_flash_mla::config
