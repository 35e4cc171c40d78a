// Split-KV scheduler kernel: the walk of docs/DESIGN.md ("Split-KV scheduling"),
// equal bit for bit to its jnp twin jax_flash_mla/scheduler.py.
//
// Grid (1), block (kThreads). The walk is inherently sequential (where a
// partition starts depends on where the previous one stopped), so it runs in
// one warp; the other warps only reduce the total cost and stage sequence
// lengths into shared memory, kChunk at a time, so any batch size works with a
// fixed shared-memory footprint. Before it, warp w tests the whole-sequence
// budget ceil(total / P) + w (w = 0 .. 2F): the smallest that fits, if at most
// 2.5 ceil(total / P), becomes the payload and the walk splits no sequence
// (DESIGN.md).
//
// Instead of visiting one sequence per step as the pseudocode does, the warp
// looks at a window of 32 sequences: lane j holds the cost (pages + F) of
// sequence batch + j, an inclusive warp scan gives the cost of finishing
// sequences batch .. batch + j, and the lanes whose prefix fits in `remain` are
// exactly those the pseudocode would finish one by one (costs are >= F > 0, so
// the prefix is strictly increasing and the finished lanes form a prefix of the
// warp). The first sequence that does not fit gets the partial take. Both
// descriptions agree whenever the int32 sums below do not overflow, i.e. while
// sum(ceil(len / 64) + F) < 2^31.

#include <cuda_runtime.h>

#include "config.h"
#include "params.h"
#include "sched_meta.h"

namespace jax_flash_mla {
namespace {

constexpr int kF = config::kSchedFixedOverheadPages;
constexpr int kCandidates = 2 * kF + 1;  // whole-sequence budgets ceil(total / P) + 0 .. 2F, one per warp
constexpr int kWarps = kCandidates + 1;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 4096;  // sequence lengths staged in shared memory per pass (16 KiB)
constexpr int kPage = config::kPageSize;
constexpr unsigned kFullMask = 0xffffffffu;

static_assert(kPage == 64, "pages_of() and the jnp twin assume 64-token pages");

// ceil(max(len, 0) / 64) without the overflow of (len + 63) / 64 near INT_MAX.
// A negative length (rejected upstream) counts as an empty sequence.
__device__ __forceinline__ int pages_of(int len) {
  const int l = max(len, 0);
  return (l >> 6) + ((l & 63) != 0 ? 1 : 0);
}

// Inclusive scan of one value per lane: the cost of finishing the window's
// sequences up to this lane's.
__device__ __forceinline__ int window_prefix_sum(int x, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += other;
  }
  return x;
}

// The walk's position, identical in every lane of warp 0.
struct WalkState {
  int part;        // partition being filled
  bool open;       // `part` has begun (its begin is recorded below)
  int begin_batch, begin_token, begin_split;
  int remain;      // budget left in `part`, in pages
  int batch;       // first unfinished sequence
  int page;        // pages of `batch` already given to earlier partitions
  int split;       // chunks of `batch` already given to earlier partitions
  int cum;         // splits of all finished sequences (num_splits[batch])
  int last_len;    // length of sequence batch - 1 (0 while batch == 0)
  int total_pages; // pages of the whole batch, written in every partition's row
};

__device__ __forceinline__ void open_partition(WalkState& s, int payload) {
  s.open = true;
  s.begin_batch = s.batch;
  s.begin_token = s.page * kPage;
  s.begin_split = s.split;
  s.remain = payload;
}

// Writes the metadata of the current partition and moves to the next one.
// End is (batch, page * 64) after a partial take, otherwise the end of the last
// finished sequence, (batch - 1, len[batch - 1]); that is (-1, 0) before any.
__device__ __forceinline__ void close_partition(WalkState& s, SchedMeta* meta, int lane) {
  if (lane == 0) {
    SchedMeta m;
    m.begin_batch = s.begin_batch;
    m.begin_token = s.begin_token;
    m.begin_split_idx = s.begin_split;
    if (s.page > 0) {
      m.end_batch = s.batch;
      m.end_token = s.page * kPage;
    } else {
      m.end_batch = s.batch - 1;
      m.end_token = s.last_len;
    }
    m.total_pages = s.total_pages;
    m.pad[0] = m.pad[1] = 0;
    meta[s.part] = m;
  }
  s.open = false;
  ++s.part;
}

// One warp's test of a whole-sequence budget: partitions take whole sequences
// while they fit; the first that does not opens the next partition.
struct FitState {
  int part;     // partition being filled
  bool open;
  int remain;   // budget left in `part`
  int batch;    // first sequence not placed
};

// Advances a FitState through the sequences staged for [chunk_begin, chunk_end).
// The budget fits iff batch reaches params.batch before part reaches P.
__device__ void fit_whole_chunk(FitState& s, const int* s_len, int chunk_begin, int chunk_end, int budget,
                                int parts, int lane) {
  while (s.part < parts && s.batch < chunk_end) {
    if (!s.open) {
      s.open = true;
      s.remain = budget;
    }
    const int seq = s.batch + lane;
    const bool valid = seq < chunk_end;
    const int prefix = window_prefix_sum(valid ? pages_of(s_len[seq - chunk_begin]) + kF : 0, lane);
    const int fits = __popc(__ballot_sync(kFullMask, valid && prefix <= s.remain));
    const int window = min(32, chunk_end - s.batch);
    if (fits == 0 && s.remain == budget) {  // one sequence costs more than the budget
      s.part = parts;
      return;
    }
    if (fits > 0) {
      s.remain -= __shfl_sync(kFullMask, prefix, fits - 1);
      s.batch += fits;
    }
    if (fits < window) {
      s.open = false;
      ++s.part;
    }
  }
}

// Warp 0: advances the walk through the sequences staged for [chunk_begin,
// chunk_end), stopping when the chunk is used up (the partition stays open) or
// every partition is closed.
__device__ void walk_chunk(WalkState& s, const int* s_len, int chunk_begin, int chunk_end, int payload,
                           bool split_ok, const SchedMetaParams& params, int lane) {
  while (s.part < params.num_sm_parts && s.batch < chunk_end) {
    if (!s.open) open_partition(s, payload);

    const int seq = s.batch + lane;
    const bool valid = seq < chunk_end;
    int len = 0, cost = 0;
    if (valid) {
      len = s_len[seq - chunk_begin];
      cost = pages_of(len) - (lane == 0 ? s.page : 0) + kF;
    }
    const int prefix = window_prefix_sum(cost, lane);
    const int fits = __popc(__ballot_sync(kFullMask, valid && prefix <= s.remain));
    const int window = min(32, chunk_end - s.batch);

    if (lane < fits) params.num_splits[seq + 1] = s.cum + s.split + lane + 1;
    if (fits > 0) {
      s.remain -= __shfl_sync(kFullMask, prefix, fits - 1);
      s.last_len = __shfl_sync(kFullMask, len, fits - 1);
      s.cum += s.split + fits;
      s.batch += fits;
      s.page = 0;
      s.split = 0;
    }
    if (fits < window) {
      // Sequence s.batch does not fit: take part of it if the overhead leaves any budget.
      if (split_ok && s.remain > kF) {
        s.page += s.remain - kF;
        ++s.split;
      }
      close_partition(s, params.sched_meta, lane);
    } else if (s.batch == params.batch) {
      close_partition(s, params.sched_meta, lane);
    }
    // Otherwise the window reached chunk_end < params.batch: go on with the next chunk.
  }
}

__global__ void __launch_bounds__(kThreads, 1) sched_meta_kernel(SchedMetaParams params) {
  __shared__ int s_len[kChunk];
  __shared__ unsigned s_warp_total[kWarps];
  __shared__ bool s_fits[kCandidates];

  const int batch = params.batch;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  // total = sum(pages + F), summed as unsigned so that overflow wraps like the
  // jnp twin's int32 instead of being undefined.
  unsigned local = 0;
  for (int i = threadIdx.x; i < batch; i += kThreads) {
    local += static_cast<unsigned>(pages_of(params.cache_seqlens[i]) + kF);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) local += __shfl_xor_sync(kFullMask, local, offset);
  if (lane == 0) s_warp_total[warp] = local;
  __syncthreads();
  unsigned total_u = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total_u += s_warp_total[w];
  const int total = static_cast<int>(total_u);
  const int parts = params.num_sm_parts;
  // ceil(total / P), as truncating division plus remainder test (the twin does the same).
  const int lower = total / parts + (total % parts != 0 ? 1 : 0);

  // Sequence lengths [chunk_begin, chunk_end) into s_len, after every warp is done with the previous chunk.
  auto stage = [&](int chunk_begin, int chunk_end) {
    __syncthreads();
    for (int i = threadIdx.x; i < chunk_end - chunk_begin; i += kThreads) {
      s_len[i] = params.cache_seqlens[chunk_begin + i];
    }
    __syncthreads();
  };

  // Pass 1: warp w < kCandidates tests the whole-sequence budget lower + w.
  FitState fit{};
  for (int chunk_begin = 0; chunk_begin < batch; chunk_begin += kChunk) {
    const int chunk_end = min(batch, chunk_begin + kChunk);
    stage(chunk_begin, chunk_end);
    if (warp < kCandidates) fit_whole_chunk(fit, s_len, chunk_begin, chunk_end, lower + warp, parts, lane);
  }
  if (warp < kCandidates && lane == 0) s_fits[warp] = fit.batch == batch;
  __syncthreads();
  int payload = lower + kF;  // split schedule
  bool split_ok = true;
  for (int w = kCandidates - 1; w >= 0; --w) {
    // Whole sequences only at a budget of at most 2.5 lower (they then keep at
    // least ~40 % of the partitions busy): 2 (lower + w) <= 5 lower, i.e.
    // 2 w <= 3 lower, with lower capped at 2F (exact for w <= 2F, no overflow).
    if (s_fits[w] && 2 * w <= 3 * min(lower, 2 * kF)) {
      payload = lower + w;
      split_ok = false;
    }
  }

  // Pass 2: the walk (the lengths of a batch of one chunk are still staged).
  WalkState s{};
  s.part = 0;
  s.open = false;
  s.total_pages = static_cast<int>(total_u - static_cast<unsigned>(kF) * static_cast<unsigned>(batch));
  if (threadIdx.x == 0) params.num_splits[0] = 0;

  for (int chunk_begin = 0; chunk_begin < batch; chunk_begin += kChunk) {
    const int chunk_end = min(batch, chunk_begin + kChunk);
    if (batch > kChunk) stage(chunk_begin, chunk_end);
    if (warp == 0) walk_chunk(s, s_len, chunk_begin, chunk_end, payload, split_ok, params, lane);
  }

  // Partitions left once every sequence is finished are empty: they begin at
  // (batch, 0, 0) and end at (batch - 1, len[batch - 1]), so begin > end.
  if (warp == 0) {
    while (s.part < parts) {
      open_partition(s, payload);
      close_partition(s, params.sched_meta, lane);
    }
  }
}

}  // namespace

void run_sched_meta(const SchedMetaParams& params) {
  // Shapes are validated by the FFI handler; nothing to launch for no partitions.
  if (params.num_sm_parts <= 0 || params.batch < 0) return;
  sched_meta_kernel<<<1, kThreads, 0, params.stream>>>(params);
  // Launch errors stay pending for the caller's cudaGetLastError().
}

}  // namespace jax_flash_mla
