// What compute-sanitizer's racecheck sees, on small kernels with known answers
// (session 22). Build and run on the GPU machine:
//   nvcc -arch=sm_90a -lineinfo -O3 -o /tmp/probe scripts/racecheck_probe.cu
//   for c in 0 1 2 3 4 5 6 7; do compute-sanitizer --tool racecheck /tmp/probe $c; done
// Cases (288 threads: two 128-thread "WGs" and one idle "producer" warp, as in the decode kernel), with what
// racecheck said in session 22 (docs/PERF.md, calls 2-5):
//   0 racy_shared:  thread 0 writes a word that thread 32 reads, no barrier, through a __shared__ pointer
//                   (STS / LDS). A real race: reported.
//   1 racy_generic: the same race through a pointer that went through an integer round trip, as the decode
//                   kernel's shared-memory plan did before session 21 (the SASS has ST.E / LD.E): reported, so
//                   racecheck follows generic accesses into shared memory.
//   2 narrow_sync:  the synchronization of consumer_narrow.cuh's chunk loop: per-WG 128-thread barriers on each
//                   page, then lanes 0-3 write row sums and warp 0 writes maxima, a 256-thread barrier, every
//                   thread reads both WGs' values, another 256-thread barrier before the next chunk. Race-free:
//                   a report here is racecheck's, not the kernel's. Clean.
//   3 narrow_racy:  case 2 without the 256-thread barriers between a chunk's reads and the next chunk's writes
//                   (the chunk-start one included). A real race: not reported.
//   4 narrow_sync_short: case 2 where every third chunk has no pages (as a zero-length sequence's chunk), so a
//                   chunk's reads and the next chunk's writes are only the two 256-thread barriers apart; the
//                   chunk's "Q" arrives by cp.async before the chunk-start barrier, as in load_q. Race-free: clean.
//   5 narrow_sync_uneven: case 2 where WG0 takes one page more than WG1 in every chunk, so it passes two more
//                   per-WG barriers per chunk than WG1 (as the few-rows kernel with an odd page count). Race-free,
//                   yet reported: racecheck behaves as if it ordered accesses by each thread's barrier count.
//   6 narrow_sync_uneven_generic: case 5 with the exchange reached through generic addresses. Race-free,
//                   reported as case 5.
//   7 narrow_sync_uneven_padded: case 5 where WG1 passes its two per-WG barriers once more after its pages, so
//                   both WGs pass as many barriers per chunk (consumer_narrow.cuh does this). Race-free: clean.
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

namespace {

constexpr int kThreads = 288;
constexpr int kChunks = 64;
constexpr int kPagesPerWg = 3;

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The dynamic shared memory rounded up to 1 KB through an integer, which hides its address space from the
// compiler (generic ST / LD with 64-bit addresses).
__device__ __forceinline__ char* generic_alias(char* smem_raw) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}

__global__ void racy_shared(float* out) {
  __shared__ volatile float word;  // volatile: otherwise the compiler drops the store nobody reads in order
  if (threadIdx.x == 0) word = 1.f;
  if (threadIdx.x == 32) out[0] = word;
}

__global__ void racy_generic(float* out) {
  extern __shared__ char smem_raw[];
  volatile float* word = reinterpret_cast<float*>(generic_alias(smem_raw));
  if (threadIdx.x == 0) *word = 1.f;
  if (threadIdx.x == 32) out[0] = *word;
}

struct Exchange {
  float col_max[2][2][4][16];  // [WG][page parity][warp][row]
  float l[2][4][16];           // [WG][warp][row]
  float m[2][16];              // [WG][row]
};
constexpr int kPatternSmem = int(sizeof(Exchange)) + 1024;  // room for the generic variant's 1 KB round-up

// Variants of the chunk loop (bits of the template argument).
enum PatternFlags : int {
  kOrdered = 1,      // the 256-thread barriers between a chunk's reads and the next chunk's writes
  kEmptyChunks = 2,  // every third chunk has no pages; "Q" by cp.async before the chunk-start barrier
  kUneven = 4,       // WG0 takes one page more than WG1 in every chunk (so it passes two more per-WG barriers)
  kGeneric = 8,      // the exchange reached through an integer round trip (generic ST / LD, as before session 21)
  kPadded = 16,      // with kUneven: WG1 passes its two per-WG barriers once more after its pages (equal counts)
};

template <int kFlags>
__global__ void narrow_pattern(float* out, const float* q) {
  extern __shared__ char smem_raw[];
  __shared__ alignas(16) float q_tile[256 * 4];
  Exchange& x = *reinterpret_cast<Exchange*>((kFlags & kGeneric) ? generic_alias(smem_raw) : smem_raw);
  const int warp_all = threadIdx.x / 32;
  if (warp_all == 8) return;  // the producer warp leaves early
  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  float acc = 0.f;
  for (int chunk = 0; chunk < kChunks; ++chunk) {
    if (kFlags & kEmptyChunks) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                       static_cast<uint32_t>(__cvta_generic_to_shared(&q_tile[4 * threadIdx.x]))),
                   "l"(q + 4 * threadIdx.x)
                   : "memory");
      asm volatile("cp.async.wait_all;\n" ::: "memory");
    }
    if (kFlags & kOrdered) bar_sync(1, 256);  // the chunk's Q is ready
    // A neighbour's word of the chunk's "Q" (only the kEmptyChunks variants load it).
    float l_part = (kFlags & kEmptyChunks) ? q_tile[(4 * threadIdx.x + 4) % 1024] : 0.f, m_ref = -1e30f;
    int pages = (kFlags & kEmptyChunks) && chunk % 3 == 1 ? 0 : kPagesPerWg;
    if ((kFlags & kUneven) && wg == 1) pages -= 1;
    for (int k = 0; k < pages; ++k) {
      const int parity = k & 1;
      const float v = float((chunk * 7 + k * 3 + tid) % 11);
      if (lane < 4) x.col_max[wg][parity][warp][lane * 4 + (chunk & 3)] = v;
      bar_sync(7 + wg, 128);
      float page_max = v;
      for (int w = 0; w < 4; ++w) page_max = fmaxf(page_max, x.col_max[wg][parity][w][(lane % 4) * 4 + (chunk & 3)]);
      m_ref = fmaxf(m_ref, page_max);
      l_part += v;
      bar_sync(9 + wg, 128);  // the WG's P tile is stored
    }
    if ((kFlags & kPadded) && wg == 1) {
      bar_sync(7 + wg, 128);
      bar_sync(9 + wg, 128);
    }
    for (int k4 = 0; k4 < 4; ++k4) {
      if (lane < 4) x.l[wg][warp][lane * 4 + k4] = l_part + k4;
      if (warp == 0 && lane < 4) x.m[wg][lane * 4 + k4] = m_ref + k4;
    }
    bar_sync(4, 256);
    for (int k4 = 0; k4 < 4; ++k4) {
      const int col = (lane % 4) * 4 + k4;
      float l = 0.f;
      for (int w = 0; w < 4; ++w) l += x.l[wg][w][col] + x.l[1 - wg][w][col];
      acc += l * fmaxf(x.m[wg][col], x.m[1 - wg][col]);
    }
    if (kFlags & kOrdered) bar_sync(11, 256);
  }
  out[blockIdx.x * 256 + threadIdx.x] = acc;
}

}  // namespace

int main(int argc, char** argv) {
  const int which = argc > 1 ? std::atoi(argv[1]) : 2;
  const int blocks = 132;
  float *out, *q;
  if (cudaMalloc(&out, blocks * 256 * sizeof(float)) != cudaSuccess) return 2;
  if (cudaMalloc(&q, 1024 * sizeof(float)) != cudaSuccess || cudaMemset(q, 0x3c, 1024 * sizeof(float))) return 2;
  const char* name = "?";
  switch (which) {
    case 0: name = "racy_shared"; racy_shared<<<1, kThreads>>>(out); break;
    case 1: name = "racy_generic"; racy_generic<<<1, kThreads, 2048>>>(out); break;
    case 2: name = "narrow_sync"; narrow_pattern<kOrdered><<<blocks, kThreads, kPatternSmem>>>(out, q); break;
    case 3: name = "narrow_racy"; narrow_pattern<0><<<blocks, kThreads, kPatternSmem>>>(out, q); break;
    case 4:
      name = "narrow_sync_short";
      narrow_pattern<kOrdered | kEmptyChunks><<<blocks, kThreads, kPatternSmem>>>(out, q);
      break;
    case 5:
      name = "narrow_sync_uneven";
      narrow_pattern<kOrdered | kUneven><<<blocks, kThreads, kPatternSmem>>>(out, q);
      break;
    case 6:
      name = "narrow_sync_uneven_generic";
      narrow_pattern<kOrdered | kUneven | kGeneric><<<blocks, kThreads, kPatternSmem>>>(out, q);
      break;
    case 7:
      name = "narrow_sync_uneven_padded";
      narrow_pattern<kOrdered | kUneven | kPadded><<<blocks, kThreads, kPatternSmem>>>(out, q);
      break;
    default: std::fprintf(stderr, "case must be 0..7\n"); return 2;
  }
  const cudaError_t err = cudaDeviceSynchronize();
  std::printf("probe case %d (%s): %s\n", which, name, cudaGetErrorString(err));
  cudaFree(out);
  cudaFree(q);
  return err == cudaSuccess ? 0 : 1;
}
