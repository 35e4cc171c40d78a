// Per-cache-format traits of the Hopper split-KV decode kernel.
//
// The kernel skeleton (splitkv_mla.cuh) is written once; everything that
// depends on how a token of the latent cache is stored lives here: element
// types, bytes per token, the shared-memory layouts the WGMMAs read, the
// TiledMMAs, the TMA box, and the SharedMemoryPlan.
//
// Tile vocabulary (per CTA, per KV head):
//   Q  : 64 query rows x 576 channels, resident for one (batch, chunk).
//   K  : one page = 64 tokens x 576 channels, streamed through kNumStages slots.
//   V  : the first 512 channels of the same K slot (MLA shares the latent).
//   P  : 64 rows x 64 tokens of softmax probabilities, exchanged between the
//        two consumer warpgroups through shared memory.
//
// Work split between the two consumer warpgroups (WG0, WG1), bf16 and
// fp8_per_tensor: pages go in pairs (A, B); WG0 computes S_A = Q K_A^T and the
// softmax of A, WG1 those of B (64 x 64, K = 576), and each WG accumulates
// both pages into its half of O: O_w += P_A V_A[:, 256w..] + P_B V_B[:, 256w..].
// No FLOP is done twice, and each page's S reads Q once (a 64 x 64 WGMMA
// instead of two 64 x 32 ones). fp8_ds_mla still splits every page's tokens
// between the WGs (kBlockNPerWG).
//
// Other formats specialize Traits<> with their own element types / layouts.
// FP8 WGMMA reads B only K-major, so fp8_per_tensor (kVNeedsTranspose) adds
// V^T buffers to its plan that the consumers fill from the K slot.
// fp8_ds_mla (kScaleGroups) has its own consumer (consumer_ds.cuh); see its
// specialization at the end of this file.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "config.h"

namespace jax_flash_mla::sm90 {

namespace decode_cfg {
inline constexpr int kBlockM = config::kRowsPerTile;  // 64 query rows per CTA tile
inline constexpr int kBlockN = config::kPageSize;     // 64 tokens per K tile (one page)
inline constexpr int kHeadDimQK = config::kHeadDimQK; // 576
inline constexpr int kHeadDimV = config::kHeadDimV;   // 512
inline constexpr int kNumConsumerWGs = 2;
inline constexpr int kNumConsumerThreads = kNumConsumerWGs * 128;
// A producer warpgroup (WG2; one lane of warp 8 issues the TMA copies) after
// the consumer warpgroups, which thus start at warp indices divisible by 4
// (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply"). A whole warpgroup
// rather than one warp because register reallocation (setmaxnreg) works per
// warpgroup and ptxas budgets registers for whole warpgroups anyway.
inline constexpr int kNumThreads = kNumConsumerThreads + 128;
// setmaxnreg only moves registers within the CTA's launch allocation:
// __launch_bounds__(kNumThreads, 1) compiles the kernel at 168 per thread
// (kLaunchRegs), so the three warpgroups' counts may add up to 3 x 168 =
// 504; over that, setmaxnreg.inc waits for good (session 14's vtpds hung
// at 232 + 232 + 48). The producer needs few (one lane walks the chunks and
// issues TMA); every register given to the consumers cuts their spills
// next to O.
inline constexpr int kLaunchRegs = 65536 / kNumThreads / 8 * 8;
inline constexpr int kConsumerRegs = 240;
inline constexpr int kProducerRegs = 24;
static_assert(kNumConsumerWGs * kConsumerRegs + kProducerRegs <= (kNumThreads / 128) * kLaunchRegs,
              "setmaxnreg counts exceed the CTA's launch allocation: setmaxnreg.inc would never return");
// L2 promotion of every cache tensor map: 128 bytes. A TMA-only stream of
// M1's pages (scripts/tma_stream_bench.cu) ran 576-byte rows at 4.23 TB/s
// with it against 3.87 with 256 bytes (which pulls in sectors of the next
// boxes' rows that are evicted before those boxes ask for them) and 3.89 with
// none; 1152-byte rows in 266.8 against 301.5 µs. The M1 decode gained 8 %
// (fp8_per_tensor), 2 % (bf16) and 1-2 % (fp8_ds_mla, whose 656-byte rows
// stream alike either way). docs/PERF.md sessions 10-11.
inline constexpr CUtensorMapL2promotion kTmaL2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
// fp8_ds_mla: each consumer WG computes S for half of the page's tokens.
inline constexpr int kBlockNPerWG = kBlockN / kNumConsumerWGs;        // 32
// Each consumer WG owns half of O's columns ...
inline constexpr int kHeadDimVPerWG = kHeadDimV / kNumConsumerWGs;    // 256
// ... which are the first four 64-channel slabs of a page (WG0: the left
// part of a K slot) or the next four (WG1, with the RoPE slab: the right
// part). bf16 and fp8_per_tensor load and release the two parts separately.
inline constexpr int kLeftSlabs = kHeadDimVPerWG / 64;                // 4
inline constexpr int kSlabs = kHeadDimQK / 64;                        // 9
// TMA boxes are 64 channels wide: a 128-byte swizzle needs an inner box
// extent of at most 128 bytes (cuTensorMapEncodeTiled, CU_TENSOR_MAP_SWIZZLE_128B).
inline constexpr int kTmaBoxChannels = 64;
}  // namespace decode_cfg

// A (rows x cols) shared-memory tile, K-major (cols contiguous), built from
// the WGMMA swizzle atom `Atom` stacked down the rows first: each slab of one
// atom's width (64 bf16 channels with SW128, 64 e4m3 bytes with SW64) is one
// contiguous block, the shape one TMA box lands in.
template <class Atom, int kRows, int kCols>
using KMajorTile = decltype(cute::tile_to_shape(Atom{}, cute::Shape<cute::Int<kRows>, cute::Int<kCols>>{}));

template <config::KvFormat kFormat>
struct Traits;  // specialized per cache format

template <>
struct Traits<config::KvFormat::kBf16> {
  using Element = cutlass::bfloat16_t;   // q, k_cache, P
  using ElementAccum = float;
  static constexpr int kBytesPerToken = config::kHeadDimQK * 2;  // 1152
  static constexpr int kNumStages = 2;
  static constexpr bool kTokenScales = false;  // design S on the page pairs (Traits<kFp8DsMlaTokenScales>)
  static constexpr bool kVNeedsTranspose = false;  // bf16 WGMMA reads MN-major B directly
  static constexpr bool kUsesDescale = false;      // no descale_q / descale_k
  static constexpr bool kScaleGroups = false;      // fp8_ds_mla's per-group scales (design A)
  // TMA element type and swizzle of the K boxes (64 channels = 128 bytes).
  static constexpr CUtensorMapDataType kTmaDataType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  static constexpr CUtensorMapSwizzle kTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr int kTmaBoxElems = decode_cfg::kTmaBoxChannels;
  // A page part (V half) lands as two pieces of two slabs, each a box of
  // make_slab_tensor_map on a full barrier of its own (the right part's RoPE
  // slab with its first piece), so a page's S issues a piece's k-steps as
  // soon as it lands. Session 25's traces: an S retired 16-20 k-steps
  // (~300-600 ns) after its page's last part landed, and a part's TMA issue
  // takes ~6 ns per KB, so the first half of a part lands ~100 ns earlier.
  // Measured (sessions 29-30): C2 span ~4 % shorter; C1 and the loop figure
  // unchanged. Four pieces of one slab (`pcs4`) were no faster.
  static constexpr int kPiecesPerPart = 2;
  static constexpr int kSlabsPerBox = decode_cfg::kLeftSlabs / kPiecesPerPart;
  static constexpr int kSlabMapSlabs = decode_cfg::kSlabs;
  // WGMMA swizzle atom matching the TMA swizzle.
  using KAtom = cute::SM90::GMMA::Layout_K_SW128_Atom<Element>;

  // Q: (64 rows, 576 ch), K-major (channel contiguous), 128-byte swizzle.
  // tile_to_shape stacks 8x64 swizzle atoms down the rows first, so each
  // 64-channel slab is one contiguous 64x64 block of 8 KB -- exactly the
  // shape one TMA box of a K page lands in.
  using SmemLayoutQ = KMajorTile<KAtom, decode_cfg::kBlockM, decode_cfg::kHeadDimQK>;
  // K page: (64 tokens, 576 ch), the same K-major layout: B operand of S = Q K^T.
  using SmemLayoutK = KMajorTile<KAtom, decode_cfg::kBlockN, decode_cfg::kHeadDimQK>;
  // V view of the same bytes: (512 ch, 64 tokens) with the channel (N of
  // O = P V) contiguous, i.e. an MN-major B operand. The MN-major 128-byte
  // atom is 64 ch x 8 tokens; stacking atoms along tokens first (Step<_2,_1>)
  // reproduces the K-major addresses above: token t of slab c sits at
  // c*4096 + t*64 (+ swizzle), in elements.
  using SmemLayoutV = decltype(cute::tile_to_shape(
      cute::SM90::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<decode_cfg::kHeadDimV>, cute::Int<decode_cfg::kBlockN>>{},
      cute::Step<cute::_2, cute::_1>{}));
  // P: (64 rows, 64 tokens), K-major: A operand of O += P V.
  using SmemLayoutP = KMajorTile<KAtom, decode_cfg::kBlockM, decode_cfg::kBlockN>;

  // One warpgroup per TiledMMA (the two consumer WGs run their own copies).
  using TiledMmaQK = decltype(cute::make_tiled_mma(
      cute::SM90_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>{}));
  // O += P V with the other WG's P from shared memory ...
  using TiledMmaPV = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{}));
  // ... and with the WG's own P from registers: the fp32 accumulator fragment
  // of a 64x64 S, rounded to bf16 element by element, is the A fragment of
  // four k16 steps (PTX ISA wgmma register fragments: same rows, and columns
  // 8j + 2(lane % 4) + {0, 1} in both).
  using TiledMmaPVRegs = decltype(cute::make_tiled_mma(
      cute::SM90_64x256x16_F32BF16BF16_RS<cute::GMMA::Major::K, cute::GMMA::Major::MN>{}));
  static constexpr bool kOwnPInRegisters = true;
  // Lazy rescale (softmax.h): p <= 2^8, far inside bf16.
  static constexpr int kLazyRescaleLog2 = 8;
  // P_A lives in page A's K slot, in the RoPE slab (slab 8, channels 512-575:
  // read only by the page's S, and laid out as a 64 x 64 K-major SW128 tile,
  // as P is), and P_B in a tile of its own. WG1 then publishes P_B without
  // waiting for its read of P_A. The right part of a slot goes back once both
  // WGs are done with it (k_empty[.][1] counts 8 warps); WG0 never reads page
  // B's, so page B's right part goes back when WG1's P_B V_B,R retired, and
  // the producer refills it first (kBRightFirst). (Each WG reads its own P
  // from registers.)
  static constexpr bool kPInRopeSlab = true;
  static constexpr int kNumPTiles = 1;
  // Page B's slot: refilled right part first, and S_B runs on it first (the
  // event trace of session 15: the next S_B waited ~1 us for its page).
  static constexpr bool kBRightFirst = true;
  // Each chunk's Q tile by the producer's TMA when the group's rows tile a
  // box, as fp8_per_tensor's (splitkv_mla.cuh: load_q_tma), the partition's
  // first tile too only after its first page (kQAfterFirstPage; a guess at
  // why that is faster: 72 KB of Q ahead of the page in the SM's TMA queue).
  // Against the consumers' cp.async copy, issued as each chunk's last WGMMA
  // retired (session 61, FlashMLA harness, H100, two runs; docs/PERF.md): in
  // the loop 0.6-6 % less time per call at b 4-128 with 128 heads, C1 / M1 the
  // same, C2 1-1.6 % less; per call, the cache from DRAM, within the runs'
  // spread.
  // With the first tile before the first page, as fp8_per_tensor's, C1's loop
  // ran 1 % slower. (Session 17's trial, 7 % slower, lost the S descriptors'
  // uniform registers to the run-time branch; today's keep them.)
  static constexpr bool kQAfterFirstPage = true;
  using QTmaElement = Element;
  static constexpr CUtensorMapDataType kQTmaDataType = kTmaDataType;
  static constexpr CUtensorMapSwizzle kQTmaSwizzle = kTmaSwizzle;
  // No few-rows kernel: a bf16 consumer_narrow (2 K stages) measured 321-324 us
  // on M1 against 324-331 us here (session 8), the page loads bound it either way.
  static constexpr int kNarrowRows = 0;

  static constexpr int kQElems = decode_cfg::kBlockM * decode_cfg::kHeadDimQK;
  static constexpr int kKElems = decode_cfg::kBlockN * decode_cfg::kHeadDimQK;
  static constexpr int kPElems = decode_cfg::kBlockM * decode_cfg::kBlockN;

  // 224 KB of tiles + 1 KB of row statistics + barriers: 225 KB, under the
  // 227 KB a block may opt into on sm_90. Two stages hold
  // exactly one page pair: each part of a slot is refilled as soon as its
  // last reader retired, and the next pair's S starts on the left parts.
  struct SharedMemoryPlan {
    // 128-byte swizzled tiles must start on 1024-byte boundaries (the swizzle
    // pattern repeats every 8 rows of 128 bytes; TMA requires it too).
    alignas(1024) Element q[kQElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element p[kNumPTiles][kPElems];  // P_B
    // Running row maxima after page A (written by WG0) and after page B (WG1).
    float ref_max[2][decode_cfg::kBlockM];
    // Partial row sums at the end of a chunk, per warpgroup.
    float row_sum[decode_cfg::kNumConsumerWGs][decode_cfg::kBlockM];
    // Per slot: TMA landed, per piece of each part (part * kPiecesPerPart +
    // piece; transaction barriers); per part (0: slabs 0-3, 1: slabs 4-8),
    // the part's consumer WG (4 warps) is done with it.
    alignas(8) uint64_t k_full[kNumStages][2 * kPiecesPerPart];
    alignas(8) uint64_t k_empty[kNumStages][2];
    alignas(8) uint64_t q_full, q_empty;
  };
  // Dynamic shared memory is only guaranteed 16-byte aligned: ask for 1 KB
  // more and round the base up.
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
  __device__ static char* q_tma_destination(SharedMemoryPlan& plan) { return reinterpret_cast<char*>(plan.q); }
};

// fp8_per_tensor: q and the cache are float8_e4m3fn, 576 bytes per token;
// descale_q / descale_k are device scalars read by the consumers (README §2).
//
// Both GEMMs run as FP8 WGMMA (e4m3 x e4m3 -> f32, k = 32 per instruction),
// which takes A and B from shared memory K-major only:
//   S = Q K^T : Q and the K page as loaded are K-major (channel contiguous).
//   O += P V  : P (64 rows x 64 tokens, e4m3, unscaled: P <= 256) is
//               K-major; V must be token-contiguous per channel, so each
//               consumer WG transposes its 256 channels of the page into a
//               V^T buffer (ldmatrix.trans + byte permutes + stmatrix,
//               transpose_v in fp8_smem.h).
// A row of one 64-channel box is 64 bytes, so every tile uses the 64-byte
// swizzle (8 rows x 64 bytes atoms); nine boxes still cover the 576
// channels, each landing as one contiguous 4 KB slab.
//
// Shared memory (bytes): Q 36864 + K 3 x 36864 + V^T 2 x 32768 + P 2 x 4096
// + a 16-byte zero row + row statistics 768 + barriers 96, plus 1 KB of
// alignment slack: kSmemBytes = 224256 (219 KB of the 227 KB opt-in limit).
// V^T and P have one buffer per page of the pair (A, B); each WG writes and
// reads only its own 256 channels of V^T.
template <>
struct Traits<config::KvFormat::kFp8PerTensor> {
  using Element = cutlass::float_e4m3_t;  // q, k_cache, P
  using ElementAccum = float;
  static constexpr int kBytesPerToken = config::kHeadDimQK;  // 576
  static constexpr int kNumStages = 3;
  static constexpr bool kTokenScales = false;  // design S on the page pairs (Traits<kFp8DsMlaTokenScales>)
  static constexpr bool kVNeedsTranspose = true;
  static constexpr bool kUsesDescale = true;
  static constexpr bool kScaleGroups = false;
  // e4m3 has no TMA data type of its own; the bytes are copied as uint8.
  static constexpr CUtensorMapDataType kTmaDataType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  static constexpr CUtensorMapSwizzle kTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_64B;
  // 64-byte boxes: 576-byte rows stream as fast through them as through
  // 128-byte ones (scripts/tma_stream_bench.cu, docs/PERF.md session 10).
  static constexpr int kTmaBoxElems = decode_cfg::kTmaBoxChannels;
  static constexpr int kPiecesPerPart = 1;  // a part in one box on one full barrier
  static constexpr int kSlabsPerBox = decode_cfg::kLeftSlabs;
  static constexpr int kSlabMapSlabs = decode_cfg::kSlabs;
  // WGMMA swizzle atom matching the TMA swizzle.
  using KAtom = cute::SM90::GMMA::Layout_K_SW64_Atom<Element>;

  using SmemLayoutQ = KMajorTile<KAtom, decode_cfg::kBlockM, decode_cfg::kHeadDimQK>;
  using SmemLayoutK = KMajorTile<KAtom, decode_cfg::kBlockN, decode_cfg::kHeadDimQK>;
  // V^T: (512 ch, 64 tokens), token contiguous (K-major B of O = P V); one
  // 64-byte row per channel, the atoms stacked down the channels.
  using SmemLayoutV = KMajorTile<KAtom, decode_cfg::kHeadDimV, decode_cfg::kBlockN>;
  using SmemLayoutP = KMajorTile<KAtom, decode_cfg::kBlockM, decode_cfg::kBlockN>;

  using TiledMmaQK = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>{}));
  using TiledMmaPV = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>{}));
  // Both WGs read P from shared memory (one tile per page). (In p_column
  // order the packed e4m3 words are also the k = 32 register A fragment; a
  // WG multiplying its own P from registers measured slower: DESIGN.md.)
  static constexpr bool kOwnPInRegisters = false;
  // Lazy rescale (softmax.h): P = e4m3(p) unscaled, p <= 2^8 < 448.
  static constexpr int kLazyRescaleLog2 = 8;
  // V^T transpose blocks whose ldmatrix go out together (fp8_smem.h): 4
  // spilled 8 B here, next to S and O.
  static constexpr int kTransposeBatch = 2;
  static constexpr int kNumPTiles = 2;
  static constexpr bool kPInRopeSlab = false;  // its P tiles are e4m3, the slot's RoPE slab is not free for them
  static constexpr bool kBRightFirst = false;  // three stages: page B' does not reuse page B's slot
  // Each chunk's Q tile by the producer's TMA when the group's rows tile a
  // box (splitkv_mla.cuh: load_q_tma): the load overlaps the last chunk's
  // epilogue instead of following it (session 17: 2.5 -> 0.14 us a hand-over).
  // It lands as SmemLayoutQ, ready for the WGMMAs.
  static constexpr bool kQAfterFirstPage = false;
  using QTmaElement = Element;
  static constexpr CUtensorMapDataType kQTmaDataType = kTmaDataType;
  static constexpr CUtensorMapSwizzle kQTmaSwizzle = kTmaSwizzle;
  // Up to 16 query rows per KV head take consumer_narrow (NarrowTraits).
  static constexpr int kNarrowRows = 16;

  static constexpr int kQElems = decode_cfg::kBlockM * decode_cfg::kHeadDimQK;
  static constexpr int kKElems = decode_cfg::kBlockN * decode_cfg::kHeadDimQK;
  static constexpr int kVtElems = decode_cfg::kHeadDimV * decode_cfg::kBlockN;
  static constexpr int kPElems = decode_cfg::kBlockM * decode_cfg::kBlockN;

  struct SharedMemoryPlan {
    alignas(1024) Element q[kQElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element vt[2][kVtElems];  // page A, page B; WG w fills channels 256w..256w+255
    alignas(1024) Element p[kNumPTiles][kPElems];
    alignas(16) Element zeros[16];  // one zero ldmatrix row: transpose_v's stale tokens
    float ref_max[2][decode_cfg::kBlockM];
    float row_sum[decode_cfg::kNumConsumerWGs][decode_cfg::kBlockM];
    alignas(8) uint64_t k_full[kNumStages][2];
    alignas(8) uint64_t k_empty[kNumStages][2];
    // The Q tile by the producer's TMA (SplitKvArgs::q_by_tma): landed; every consumer warp done with it.
    alignas(8) uint64_t q_full, q_empty;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
  // Where load_q_tma's boxes land: the Q tile itself.
  __device__ static char* q_tma_destination(SharedMemoryPlan& plan) { return reinterpret_cast<char*>(plan.q); }
};

// fp8_ds_mla's plans take load_q_tma's boxes (raw bf16 q, nine 8 KB slabs of 64 rows x 64 channels) in their
// V^T and P tiles, one region, idle between chunks: the tiles must be adjacent and hold all of q.
template <class Plan, class QTmaElement>
constexpr bool q_tma_fits_vt_and_p() {
  return offsetof(Plan, p) == offsetof(Plan, vt) + sizeof(Plan::vt) &&
         sizeof(Plan::vt) + sizeof(Plan::p) >= decode_cfg::kBlockM * decode_cfg::kHeadDimQK * sizeof(QTmaElement);
}

// fp8_ds_mla: 656-byte tokens (README §2 of shared/): bytes 0-511 e4m3 NoPE,
// 512-527 four fp32 scales (scale g multiplies channels 128g..128g+127),
// 528-655 64 bf16 RoPE. q arrives as bf16. Design A of docs/NUMERICS.md:
//   - Q prologue (kScaleGroups): q NoPE is quantized to e4m3 per row with
//     the power-of-two scale qs = 2^ceil(log2(amax/448)); RoPE stays bf16,
//     stored as q_rope / qs (exact).
//   - S = qs * (Q_rope' K_rope^T (bf16 WGMMA, 4 k-steps) + sum over groups g
//     of k_scale[t,g] * T_g), each T_g a fresh FP8 WGMMA (4 k-steps of 32)
//     promoted in fp32 by one FFMA per score.
//   - P per output group: P_g[t] = e4m3(p[t] * k_scale[t,g] * 16 / N_g),
//     N_g the largest k_scale[., g] of the chunk's tokens so far (a power of
//     two, so the factor is exact); the row sum keeps the unrounded p.
//   - O_g += P_g V_g (FP8 WGMMA, 2 k-steps) straight into O, which holds
//     O_g * 16 / N_g: when N_g grows, O_g shrinks by N_old / N_new (with the
//     row-max rescale), and the epilogue multiplies by N_g / 16. p <= 16 by
//     the lazy rescale (kLazyRescaleLog2), so P_g <= 256. V^T is
//     transposed from the slot as for fp8_per_tensor.
//
// TMA: two uint8 maps over (656 bytes, head, token-in-page, block). The
// cache map has 128-byte boxes and the 128-byte swizzle: four NoPE slabs at
// bytes 0..511 and one RoPE slab at byte 528 (64 bf16 channels), each a
// contiguous 8 KB slab (64 tokens x 128 bytes, SW128). The scale map has
// 16-byte boxes, no swizzle: the four scales at byte 512, 1 KB per page.
// 41984 bytes per slot in six copies. (Eleven 64-byte boxes, as for
// fp8_per_tensor, streamed M1's pages at 3.48 TB/s against 4.15 through
// 128-byte ones: a 656-byte row puts every second 64-byte piece across a
// 32-byte sector boundary; scripts/tma_stream_bench.cu, docs/PERF.md session 10.)
// Q keeps the 64-byte swizzle (the WGMMA descriptors of each operand carry
// their own), so only the slot's layouts change.
//
// Shared memory (bytes): Q NoPE 32768 + Q RoPE 8192
// + K 2 x 41984 + V^T 2 x 32768 + P 4 x 4096 + a 16-byte zero row + q scales
// 256 + row lags 256 + row statistics 1536 + the consumers' page-loop
// addressing 8192 + barriers 48, padded to 1 KB, plus 1 KB of alignment
// slack: kSmemBytes = 219136 (214 KB of the 227 KB opt-in limit). A third
// stage would add 41 KB, so kNumStages = 2.
template <>
struct Traits<config::KvFormat::kFp8DsMla> {
  using Element = cutlass::float_e4m3_t;  // quantized q NoPE, cache NoPE, P
  using ElementRope = cutlass::bfloat16_t;
  using ElementAccum = float;
  static constexpr int kBytesPerToken = config::kDsMlaBytesPerToken;  // 656
  static constexpr int kNumStages = 2;
  static constexpr bool kTokenScales = false;  // design S on the page pairs (Traits<kFp8DsMlaTokenScales>)
  static constexpr bool kVNeedsTranspose = true;
  static constexpr bool kUsesDescale = false;
  static constexpr bool kScaleGroups = true;  // design A (kQuantizeQ, kPromoteQK, kPPerGroup, kPromotePV)
  // q (bf16) by the producer's TMA when the group's rows tile a box, into the
  // V^T / P tiles (idle between a chunk's last P V and the next chunk's first
  // transpose) with the 128-byte swizzle; load_q_ds quantizes it from there.
  static constexpr bool kQAfterFirstPage = false;
  using QTmaElement = cutlass::bfloat16_t;
  static constexpr CUtensorMapDataType kQTmaDataType = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  static constexpr CUtensorMapSwizzle kQTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr int kNumGroups = 4;        // 128-channel scale groups of the NoPE part
  static constexpr int kGroupChannels = 128;
  // P_g = e4m3(p * k_scale[t, g] * kPNormalizer / N_g) with the lazy rescale's
  // p <= 2^kLazyRescaleLog2: at most 16 * 16 = 256 < 448. (A normalizer of 16
  // instead of 256 for p <= 1 emulates to the same error: docs/NUMERICS.md.)
  static constexpr int kLazyRescaleLog2 = 4;
  static constexpr float kPNormalizer = 16.f;
  // V^T transpose blocks whose ldmatrix go out together (fp8_smem.h): one at
  // a time here: with the per-row q scale and cached token scales, batches of
  // 4 measured 2-4 % slower than single blocks and batches of 2 the same
  // (session 7; before those changes, batches of 4 had been 3 % faster).
  static constexpr int kTransposeBatch = 1;
  // Up to 16 query rows per KV head take consumer_narrow (NarrowTraits), with ds_scales="token" too.
  static constexpr int kNarrowRows = 16;
  static_assert((1 << kLazyRescaleLog2) * kPNormalizer <= 256.f, "P_g inside e4m3 (448)");
  static constexpr int kHeadDimNope = config::kHeadDimV;  // 512
  static constexpr int kHeadDimRope = config::kHeadDimQK - config::kHeadDimV;  // 64
  static constexpr CUtensorMapDataType kTmaDataType = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  static constexpr CUtensorMapSwizzle kTmaSwizzle = CU_TENSOR_MAP_SWIZZLE_128B;
  static constexpr int kTmaBoxElems = 128;  // bytes of the cache map's boxes
  // A token's four fp32 scales: the scale map's box width and a row of the
  // slot's scale block.
  static constexpr int kScaleRowBytes = 16;
  // WGMMA swizzle atoms: the slot's (matching the cache map) and Q's, V^T's, P's.
  using KAtomCache = cute::SM90::GMMA::Layout_K_SW128_Atom<Element>;
  using KAtomCacheRope = cute::SM90::GMMA::Layout_K_SW128_Atom<ElementRope>;
  using KAtom = cute::SM90::GMMA::Layout_K_SW64_Atom<Element>;
  using KAtomRope = cute::SM90::GMMA::Layout_K_SW64_Atom<ElementRope>;

  // A K slot: NoPE slabs (64 tokens x 128 bytes, 8 KB each), the RoPE slab,
  // then the scales (64 tokens x 16 bytes).
  static constexpr int kNopeSlabBytes = decode_cfg::kBlockN * kTmaBoxElems;
  static constexpr int kNopeSlabs = kHeadDimNope / kTmaBoxElems;       // 4, bytes 0..511 of a token
  // make_slab_tensor_map: the NoPE slabs in one box (the RoPE slab, at byte 528, is not slab-aligned).
  static constexpr int kSlabsPerBox = kNopeSlabs;
  static constexpr int kSlabMapSlabs = kNopeSlabs;
  static constexpr int kRopeOffset = kNopeSlabs * kNopeSlabBytes;      // 32768
  static constexpr int kScaleOffset = kRopeOffset + decode_cfg::kBlockN * kHeadDimRope * 2;  // 40960
  static constexpr int kQSlabBytes = decode_cfg::kBlockM * 64;  // Q NoPE: 64 rows x 64 bytes per SW64 slab
  // TMA box origins (byte offsets within the token).
  static constexpr int kScaleByte = kHeadDimNope;        // 512
  static constexpr int kRopeByte = kHeadDimNope + 16;    // 528

  // Q NoPE (64 rows, 512 ch): e4m3, K-major, SW64 (load_q_ds writes it).
  using SmemLayoutQ = KMajorTile<KAtom, decode_cfg::kBlockM, kHeadDimNope>;
  // The K slot's NoPE (64 tokens, 512 ch): K-major, SW128, as the boxes land.
  using SmemLayoutK = KMajorTile<KAtomCache, decode_cfg::kBlockN, kHeadDimNope>;
  // RoPE (64 rows / tokens, 64 bf16 ch), K-major: Q's SW64 (8 x 32-channel
  // atoms stacked down the rows first), the slot's one SW128 slab.
  using SmemLayoutQRope = KMajorTile<KAtomRope, decode_cfg::kBlockM, kHeadDimRope>;
  using SmemLayoutKRope = KMajorTile<KAtomCacheRope, decode_cfg::kBlockN, kHeadDimRope>;
  using SmemLayoutV = KMajorTile<KAtom, decode_cfg::kHeadDimV, decode_cfg::kBlockN>;
  using SmemLayoutP = KMajorTile<KAtom, decode_cfg::kBlockM, decode_cfg::kBlockN>;

  using TiledMmaQKRope = decltype(cute::make_tiled_mma(
      cute::SM90_64x32x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>{}));
  using TiledMmaQKNope = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x32x32_F32E4M3E4M3_SS_TN<>{}));
  // The skeleton's generic names (the consumer of this format uses the two above).
  using TiledMmaQK = TiledMmaQKNope;
  // A WG owns output groups 2w and 2w+1 (256 channels): one 64x128 WGMMA
  // block per group, accumulating straight into O (O_g is kept in units of
  // N_g / kPNormalizer, so no per-page temporary is needed).
  using TiledMmaPV = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x128x32_F32E4M3E4M3_SS_TN<>{}));

  static constexpr int kQElems = decode_cfg::kBlockM * kHeadDimNope;
  static constexpr int kQRopeElems = decode_cfg::kBlockM * kHeadDimRope;
  static constexpr int kKElems = kScaleOffset + decode_cfg::kBlockN * kScaleRowBytes;  // 41984 bytes a slot
  static constexpr int kVtElems = decode_cfg::kHeadDimV * decode_cfg::kBlockN;
  static constexpr int kPElems = decode_cfg::kBlockM * decode_cfg::kBlockN;
  static constexpr uint32_t kKTileBytes = kKElems;  // every byte of a slot comes through TMA

  struct SharedMemoryPlan {
    alignas(1024) Element q[kQElems];
    alignas(1024) ElementRope q_rope[kQRopeElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element vt[2][kVtElems];
    alignas(1024) Element p[kNumGroups][kPElems];  // P_g, one tile per output group
    alignas(16) Element zeros[16];  // one zero ldmatrix row: transpose_v's stale tokens
    float q_scale[decode_cfg::kBlockM];  // q's per-row power-of-two scale
    // Under causal, how many of the sequence's last keys a row does not see: s_q - 1 - its query token
    // (negative for the padding rows past q_rows_per_head_k). Written with q_scale, read per page.
    int row_lag[decode_cfg::kBlockM];
    float row_max[2][decode_cfg::kNumConsumerWGs][decode_cfg::kBlockM];
    float row_sum[decode_cfg::kNumConsumerWGs][decode_cfg::kBlockM];
    // consumer_ds's page-loop addressing, 32 bytes a consumer thread (its transpose_v lane, P-store offset and
    // first token): written by the thread before its first chunk, read back by it alone on every page. Kept in
    // registers it would sit next to O, so ptxas recomputed it from the thread index every page instead.
    alignas(16) uint4 page_lane[decode_cfg::kNumConsumerThreads][2];
    alignas(8) uint64_t k_full[kNumStages];
    alignas(8) uint64_t k_empty[kNumStages];
    // q by the producer's TMA (SplitKvArgs::q_by_tma): landed; every consumer warp done with the tiles it fills.
    alignas(8) uint64_t q_full, q_empty;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
  static_assert(q_tma_fits_vt_and_p<SharedMemoryPlan, QTmaElement>(), "q by TMA fits the V^T and P tiles");
  // Design S's plan (Traits<kFp8DsMlaTokenScales>) has the same region, so this serves both.
  template <class Plan>
  __device__ static char* q_tma_destination(Plan& plan) { return reinterpret_cast<char*>(plan.vt); }
  static_assert(kKElems % 1024 == 0, "slots stay 1024-byte aligned");
};

// fp8_ds_mla's bytes on the page pairs, design S (docs/DESIGN.md, "Design S on the page pairs: the build"). On a
// page whose tokens carry one scale each (quantize_kv_cache(..., ds_scales="token")), a token's NoPE bytes are
// e4m3(value / k[t]), so with q's row scale qs:
//   S = qs * (k[t] * Q8 K8^T + (q_rope / qs) k_rope^T)
// from two fp32 accumulators: 16 FP8 k-steps over the NoPE slabs and 4 bf16 k-steps over the RoPE slab, added
// with one FFMA a score (k[t] from the page table the producer warpgroup's prep warps write). Dividing the RoPE
// slab by k[t] in shared memory instead, for one accumulator, put the prep's pass on the pair's critical path: 17-22 %
// of C1's time (docs/PERF.md, sessions 65-66). P = e4m3(p * k[t] * 16 / N), N the chunk's running max of k
// (in the page table), and O carries N / 16 as consumer_ds's O_g carries N_g / 16.
// The pair pipeline is fp8_per_tensor's with two stages (early S kept: session 63's st2e ran fp8_per_tensor's
// pairs at main's speed on two stages). A K slot is two parts: left = NoPE slabs 0-1 (V channels 0-255), right =
// NoPE slabs 2-3, the RoPE slab and the scales.
//
// Shared memory (bytes): Q NoPE 32768 + Q RoPE 8192 + K 2 x 41984 + V^T 2 x 32768 + P 4 x 4096 + page tables
// 2 x 288 + zero row + q scales and row lags 512 + row statistics 1024 + barriers, plus 1 KB of alignment slack.
template <>
struct Traits<config::KvFormat::kFp8DsMlaTokenScales> : Traits<config::KvFormat::kFp8DsMla> {
  using Base = Traits<config::KvFormat::kFp8DsMla>;
  static constexpr int kNumStages = 2;
  static constexpr bool kScaleGroups = false;  // consumer(), the page pairs
  static constexpr bool kTokenScales = true;
  static constexpr int kPiecesPerPart = 1;
  static constexpr int kSlabsPerBox = 2;  // a part's two NoPE slabs as one box of the slab map
  static constexpr int kLeftBytes = kSlabsPerBox * kNopeSlabBytes;                            // 16384
  static constexpr int kRightBytes = kKElems - kLeftBytes;                                    // 25600
  static constexpr bool kOwnPInRegisters = false;
  static constexpr int kNumPTiles = 2;
  static constexpr bool kPInRopeSlab = false;
  static constexpr bool kBRightFirst = false;
  static constexpr int kNarrowRows = 0;  // the few-rows kernel stays design A (NarrowTraits<kFp8DsMla>)

  // S over a whole page (N = 64), NoPE and RoPE into accumulators of their own; P V as fp8_per_tensor's.
  using TiledMmaQKNope = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x64x32_F32E4M3E4M3_SS_TN<>{}));
  using TiledMmaQKRope = decltype(cute::make_tiled_mma(
      cute::SM90_64x64x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>{}));
  using TiledMmaQK = TiledMmaQKNope;
  using TiledMmaPV = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x256x32_F32E4M3E4M3_SS_TN<>{}));

  // What the prep warps leave for a page: k[t] for the S and P factors, the chunk's running N through this
  // page, and whether the page was uniform (its bytes as written) or shifted to its tokens' largest scales.
  struct PageTable {
    float k[decode_cfg::kBlockN];
    float running_n;
    uint32_t shifted;
    uint32_t warp_max[2];      // the two prep warps' largest k (float bits), combined behind kPrepExchange
    uint32_t warp_uniform[2];  // and whether all their tokens' four scales were equal
  };
  // The producer warpgroup's warps 1 and 2 prepare the pages (ds_page_prep.cuh).
  static constexpr int kPrepWarps = 2;
  // Page tables ring twice as deep as the K slots: the prep of page i waits for the consumers to be done with page
  // i - 4's table, long past, rather than page i - 2's, which WG1 hands back only as it issues page i's S (with
  // kNumStages entries that put the prep's whole latency on WG1's chain once a pair).
  static constexpr int kTableSlots = 2 * kNumStages;

  struct SharedMemoryPlan {
    alignas(1024) Element q[kQElems];
    alignas(1024) ElementRope q_rope[kQRopeElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element vt[2][kVtElems];  // page A, page B; WG w fills channels 256w..256w+255
    // P_A, P_B; the other two tiles' 8 KB only complete load_q_ds's staging copy of q (V^T and P, idle between
    // chunks, hold it).
    alignas(1024) Element p[4][kPElems];
    alignas(16) PageTable table[kTableSlots];
    alignas(16) Element zeros[16];  // one zero ldmatrix row: transpose_v's stale tokens
    float q_scale[decode_cfg::kBlockM];
    int row_lag[decode_cfg::kBlockM];  // written by load_q_ds (consumer_ds's causal limits); unread here
    float ref_max[2][decode_cfg::kBlockM];
    float row_sum[decode_cfg::kNumConsumerWGs][decode_cfg::kBlockM];
    alignas(8) uint64_t k_full[kNumStages][2];
    alignas(8) uint64_t k_empty[kNumStages][2];
    // Per slot: the prep warps are done with the page (table written, NoPE shifted where needed). Per table: every
    // consumer warp is done with it.
    alignas(8) uint64_t prepared[kNumStages];
    alignas(8) uint64_t table_empty[kTableSlots];
    alignas(8) uint64_t q_full, q_empty;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
  static_assert(q_tma_fits_vt_and_p<SharedMemoryPlan, QTmaElement>(), "q by TMA fits the V^T and P tiles");
  static_assert(kLeftBytes % 1024 == 0 && kKElems % 1024 == 0, "parts and slots stay 1024-byte aligned");
};

// ------------------------------------------------------------------ few query rows
// q_rows_per_head_k <= kNarrowRows (16: h_q 16 with s_q 1, or fewer heads) runs
// consumer_narrow.cuh: S^T = K Q^T and O^T = V^T P^T with the page's tokens and
// V's channels as the WGMMA's 64 rows and the query rows as N = 16, the two
// consumer WGs on alternate pages. Its plan has no V^T tiles (V^T is built in
// registers) and no 64-row P tiles; the bytes go to one more K stage each.
// (These shapes are bound by page loads, but a TMA-only stream of M1's pages
// runs as fast with 2 stages as with 6: docs/DESIGN.md, session 10.)
namespace narrow_cfg {
inline constexpr int kRows = 16;
inline constexpr int kPtElems = kRows * decode_cfg::kBlockN;  // one P^T tile: 16 rows x 64 tokens
// The chunk-end hand-off between the two WGs (epilogue_narrow): each gives the
// other its O^T values of the other's 256 channels (4 m64 blocks x 8 values per
// thread), its partial row sums per warp and its reference maxima. A chunk's
// writes follow the previous chunk's reads behind kExchangeRead.
struct Exchange {
  float o[decode_cfg::kNumConsumerWGs][32][128];     // [from WG][value][thread]
  float l[decode_cfg::kNumConsumerWGs][4][kRows];    // [WG][warp][query row]
  float m[decode_cfg::kNumConsumerWGs][kRows];       // [WG][query row]
};
}  // namespace narrow_cfg

template <config::KvFormat kFormat>
struct NarrowTraits;  // defined for the formats with Traits::kNarrowRows > 0

// The WGMMAs of the transposed problem, shared by both FP8 formats.
struct NarrowMmas {
  // S^T (or a scale group's T^T) = K Q^T: A = the K slot, B = Q's first 16 rows, both K-major.
  using TiledMmaS = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_SS_TN<>{}));
  // O^T += V^T P^T: A = V^T from registers (ldmatrix.trans + PRMT), B = P^T, K-major.
  using TiledMmaO = decltype(cute::make_tiled_mma(cute::SM90::GMMA::MMA_64x16x32_F32E4M3E4M3_RS_TN<>{}));
};

// fp8_per_tensor: Q 36864 (64 rows as load_q writes them; 16 are read) + K 4 x
// 36864 + P^T 2 WGs x 2 parities x 1024 + exchange 33408 + column maxima 1024
// + zero row + barriers, plus 1 KB of alignment slack.
template <>
struct NarrowTraits<config::KvFormat::kFp8PerTensor> : Traits<config::KvFormat::kFp8PerTensor>, NarrowMmas {
  static constexpr int kNumStages = 4;
  using SmemLayoutPt = KMajorTile<KAtom, narrow_cfg::kRows, decode_cfg::kBlockN>;
  struct SharedMemoryPlan {
    alignas(1024) Element q[kQElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element p[decode_cfg::kNumConsumerWGs][2][narrow_cfg::kPtElems];  // [WG][page parity]
    narrow_cfg::Exchange exchange;
    float col_max[decode_cfg::kNumConsumerWGs][2][4][narrow_cfg::kRows];  // [WG][page parity][warp][query row]
    alignas(16) Element zeros[16];  // the ldmatrix row of tokens past the chunk
    alignas(8) uint64_t k_full[decode_cfg::kNumConsumerWGs][kNumStages][2];  // [WG taking the page][stage][part]
    alignas(8) uint64_t k_empty[kNumStages][2];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
};

// fp8_ds_mla: Q NoPE 32768 + Q RoPE 8192 + K 3 x 41984 + P^T 2 WGs x 4 groups
// x 2 parities x 1024 + exchange 33408 + q scales 256 + column maxima 1024 +
// zero row + barriers, plus 1 KB of alignment slack.
template <>
struct NarrowTraits<config::KvFormat::kFp8DsMla> : Traits<config::KvFormat::kFp8DsMla>, NarrowMmas {
  static constexpr int kNumStages = 3;
  using SmemLayoutPt = KMajorTile<KAtom, narrow_cfg::kRows, decode_cfg::kBlockN>;
  // The RoPE part of S^T: bf16, A = the slot's RoPE slabs, B = Q's RoPE rows.
  using TiledMmaRope = decltype(cute::make_tiled_mma(
      cute::SM90_64x16x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>{}));
  struct SharedMemoryPlan {
    alignas(1024) Element q[kQElems];
    alignas(1024) ElementRope q_rope[kQRopeElems];
    alignas(1024) Element k[kNumStages][kKElems];
    alignas(1024) Element p[decode_cfg::kNumConsumerWGs][kNumGroups][2][narrow_cfg::kPtElems];  // [WG][g][parity]
    narrow_cfg::Exchange exchange;
    float q_scale[decode_cfg::kBlockM];
    float col_max[decode_cfg::kNumConsumerWGs][2][4][narrow_cfg::kRows];
    alignas(16) Element zeros[16];
    alignas(8) uint64_t k_full[decode_cfg::kNumConsumerWGs][kNumStages];  // [WG taking the page][stage]
    alignas(8) uint64_t k_empty[kNumStages];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedMemoryPlan)) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared-memory plan exceeds the sm_90 opt-in limit");
};

}  // namespace jax_flash_mla::sm90
