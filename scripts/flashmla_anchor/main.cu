// FlashMLA's dense bf16 decode against ours, on the same inputs, timed the same way, in one process on one card:
// issue 3's anchors (FlashMLA 309 / 489 / 908 µs) were measured on an H200, and this re-measures them beside our
// kernel on whatever card the device tool lends. FlashMLA's sources are not part of this repository: build.sh
// compiles this against a checkout of github.com/deepseek-ai/FlashMLA (no GPU needed) into
// .carry_fmla/flashmla_anchor; carry that folder to the GPU machine and run
//   .carry_fmla/flashmla_anchor [M1,C1,C2,b4s16384h128q1,...] [repeats]
// (ab.sh here runs several builds of it alternately and prints their ratios to FlashMLA; ncu_compare.sh profiles
// both split-KV kernels under Nsight Compute.)
// Per shape (h_kv 1; M1 = h_q 16, s_q 1; C1 = h_q 128, s_q 1; C2 = h_q 128, s_q 2, causal, all three at batch 128
// and s_k 8192; any other as b<batch>s<s_k>h<h_q>q<s_q>[c][v], parse_shape below),
// with standard-normal q and cache and a shuffled block table as our bench has:
//   - both decodes' outputs are compared (max |difference| and rel-L2 of out, max |difference| of lse; a rel-L2
//     above 1e-2, five times two bf16 roundings apart, stops the run);
//   - each decode (split-KV kernel + combine; the scheduler metadata computed once, outside the timing, as
//     FlashMLA's benchmark does) is timed two ways, the two decodes interleaved (time_pair), `repeats` times
//     (default 2): `per call` = CUDA events around one call after a 256 MB write that evicts L2, 100 times
//     (triton's do_bench, which the anchors came from: median and mean); `loop` = events around 50 calls back to
//     back, 6 times (median per call: our bench's loop figure less its glue); and the split-KV kernel alone in the
//     same loops and per call after the same write, which splits the time between the two kernels. At small
//     shapes the two regimes differ: in a loop the cache (up to ~40 MB) stays in L2 from call to call; per call,
//     it comes from DRAM, as a serving step's next layer finds it.
//   FlashMLA's split-KV kernel is launched with programmatic dependent launch allowed, signals its dependents before
//   its stores and never waits on the kernel before it, so in the split-KV-alone loop each launch starts while the
//   last one's stores drain; ours waits for the last grid (griddepcontrol.wait), as it must where that grid wrote
//   its inputs. SPLITKV_LOOP_BARRIER=1 puts an empty kernel (a plain launch) after each split-KV launch of that
//   loop, for both sides, so neither overlaps the last: the split-KV kernels' times as a serving step sees them,
//   with something else launched between, plus the empty kernel's.
// First, a small case (2 sequences, s_q 2, causal, 16 heads) checks both against a float64 reference on the host.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "../bench_ptx.h"  // CHECK: the helpers of the other measurement tools in scripts/
#include "decoders.h"

namespace {

__global__ void empty_kernel() {}

// Standard-normal bf16 values from a counter hash (Box-Muller): the same data on every run.
__global__ void fill_normal(__nv_bfloat16* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t v = (uint64_t(seed) << 40) ^ i;
    v ^= v >> 33;
    v *= 0xff51afd7ed558ccdull;
    v ^= v >> 33;
    v *= 0xc4ceb9fe1a85ec53ull;
    v ^= v >> 33;
    const float u1 = (float(uint32_t(v)) + 1.f) * 0x1p-32f, u2 = float(uint32_t(v >> 32)) * 0x1p-32f;
    x[i] = __float2bfloat16(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2));
  }
}

template <typename T>
T* device_alloc(size_t n) {
  T* p;
  CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

template <typename T>
std::vector<T> to_host(const T* x, size_t n) {
  std::vector<T> h(n);
  CHECK(cudaMemcpy(h.data(), x, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<float> to_float(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = __bfloat162float(x[i]);
  return f;
}

// Inputs of one shape on the device and each decode's outputs.
struct Problem {
  DecodeInputs in{};
  std::vector<int> lens, table;
  DecodeOutputs fmla{}, ours{};
  size_t q_elems, k_elems, out_elems, lse_elems;

  Problem(std::vector<int> lens_, int s_q, int h_q, bool causal, int num_sms, uint32_t seed) : lens(lens_) {
    in.b = int(lens.size());
    in.s_q = s_q;
    in.h_q = h_q;
    in.causal = causal;
    in.softmax_scale = 1.f / std::sqrt(float(kHeadDim));
    in.num_sms = num_sms;
    in.max_pages = 1;
    for (int l : lens) in.max_pages = std::max(in.max_pages, (l + kPage - 1) / kPage);
    const size_t pages = size_t(in.b) * in.max_pages;
    q_elems = size_t(in.b) * s_q * h_q * kHeadDim;
    k_elems = pages * kPage * kHeadDim;
    out_elems = size_t(in.b) * s_q * h_q * kHeadDimV;
    lse_elems = size_t(in.b) * s_q * h_q;
    auto* q = device_alloc<__nv_bfloat16>(q_elems);
    auto* k = device_alloc<__nv_bfloat16>(k_elems);
    fill_normal<<<1024, 256>>>(q, q_elems, seed);
    fill_normal<<<4096, 256>>>(k, k_elems, seed + 1);
    CHECK(cudaGetLastError());
    table.resize(pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(seed));
    int* table_d = device_alloc<int>(pages);
    int* lens_d = device_alloc<int>(in.b);
    CHECK(cudaMemcpy(table_d, table.data(), pages * sizeof(int), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(lens_d, lens.data(), in.b * sizeof(int), cudaMemcpyHostToDevice));
    in.q = q;
    in.k_cache = k;
    in.block_table = table_d;
    in.seqlens = lens_d;
    for (DecodeOutputs* o : {&fmla, &ours}) {
      o->out = device_alloc<__nv_bfloat16>(out_elems);
      o->lse = device_alloc<float>(lse_elems);
    }
  }

  ~Problem() {
    for (const void* p : {in.q, in.k_cache, static_cast<const void*>(in.block_table),
                          static_cast<const void*>(in.seqlens), static_cast<const void*>(fmla.out),
                          static_cast<const void*>(fmla.lse), static_cast<const void*>(ours.out),
                          static_cast<const void*>(ours.lse)})
      cudaFree(const_cast<void*>(p));
  }

  // Row r = (s, h) of sequence i: FlashMLA's lse is [b, s_q, h_q], ours [b, h_q, s_q].
  size_t lse_index(bool ours_order, int i, int s, int h) const {
    return ours_order ? (size_t(i) * in.h_q + h) * in.s_q + s : (size_t(i) * in.s_q + s) * in.h_q + h;
  }
};

// The float64 reference of one decode: row (s, h) of sequence i sees its first len_i - (s_q - 1 - s) keys under
// causal (all len_i otherwise), scores scaled by the inputs' softmax_scale (576^-0.5), V = the first 512 channels.
bool check_small_case(int num_sms) {
  Problem p({300, 77}, 2, 16, true, num_sms, 7);
  Decode fmla = flashmla_bf16_decode(p.in, p.fmla), ours = our_bf16_decode(p.in, p.ours);
  fmla(0);
  ours(0);
  CHECK(cudaDeviceSynchronize());
  const auto q = to_float(to_host(static_cast<const __nv_bfloat16*>(p.in.q), p.q_elems));
  const auto k = to_float(to_host(static_cast<const __nv_bfloat16*>(p.in.k_cache), p.k_elems));
  bool ok = true;
  for (bool ours_side : {false, true}) {
    const DecodeOutputs& o = ours_side ? p.ours : p.fmla;
    const auto out = to_float(to_host(static_cast<const __nv_bfloat16*>(o.out), p.out_elems));
    const auto lse = to_host(o.lse, p.lse_elems);
    double err2 = 0, ref2 = 0, lse_err = 0;
    for (int i = 0; i < p.in.b; ++i) {
      for (int s = 0; s < p.in.s_q; ++s) {
        for (int h = 0; h < p.in.h_q; ++h) {
          const int visible = p.lens[i] - (p.in.causal ? p.in.s_q - 1 - s : 0);
          const float* qr = &q[((size_t(i) * p.in.s_q + s) * p.in.h_q + h) * kHeadDim];
          auto key = [&](int t) {
            return &k[(size_t(p.table[size_t(i) * p.in.max_pages + t / kPage]) * kPage + t % kPage) * kHeadDim];
          };
          std::vector<double> score(visible);
          double m = -INFINITY, sum = 0;
          for (int t = 0; t < visible; ++t) {
            double dot = 0;
            for (int c = 0; c < kHeadDim; ++c) dot += double(qr[c]) * key(t)[c];
            score[t] = dot * p.in.softmax_scale;
            m = std::max(m, score[t]);
          }
          for (int t = 0; t < visible; ++t) sum += std::exp(score[t] - m);
          for (int c = 0; c < kHeadDimV; ++c) {
            double ref = 0;
            for (int t = 0; t < visible; ++t) ref += std::exp(score[t] - m) / sum * key(t)[c];
            const double d = out[((size_t(i) * p.in.s_q + s) * p.in.h_q + h) * kHeadDimV + c] - ref;
            err2 += d * d;
            ref2 += ref * ref;
          }
          lse_err = std::max(lse_err, std::abs(lse[p.lse_index(ours_side, i, s, h)] - (m + std::log(sum))));
        }
      }
    }
    const double rel_l2 = std::sqrt(err2 / ref2);
    const bool side_ok = rel_l2 < 1e-2 && lse_err < 1e-2;  // bf16 output: ~2e-3
    ok = ok && side_ok;
    std::printf("[flashmla_anchor] small case (b 2, s_q 2, h_q 16, causal), %-8s vs float64: rel-L2 %.3e, "
                "max |lse err| %.3e: %s\n",
                ours_side ? "ours" : "FlashMLA", rel_l2, lse_err, side_ok ? "ok" : "MISMATCH");
  }
  return ok;
}

// The two decodes' outputs of one shape against each other; false when they disagree.
bool compare_outputs(const Problem& p) {
  const auto a = to_float(to_host(static_cast<const __nv_bfloat16*>(p.fmla.out), p.out_elems));
  const auto b = to_float(to_host(static_cast<const __nv_bfloat16*>(p.ours.out), p.out_elems));
  const auto la = to_host(p.fmla.lse, p.lse_elems), lb = to_host(p.ours.lse, p.lse_elems);
  double diff2 = 0, ref2 = 0, max_diff = 0, abs_sum = 0, lse_diff = 0;
  bool finite = true;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - b[i];
    diff2 += d * d;
    ref2 += double(a[i]) * a[i];
    max_diff = std::max(max_diff, std::abs(d));
    abs_sum += std::abs(b[i]);
    finite = finite && std::isfinite(a[i]) && std::isfinite(b[i]);
  }
  for (int i = 0; i < p.in.b; ++i)
    for (int s = 0; s < p.in.s_q; ++s)
      for (int h = 0; h < p.in.h_q; ++h)
        lse_diff = std::max(lse_diff, double(std::abs(la[p.lse_index(false, i, s, h)] -
                                                      lb[p.lse_index(true, i, s, h)])));
  const double rel_l2 = std::sqrt(diff2 / ref2);
  const bool ok = finite && rel_l2 < 1e-2 && lse_diff < 1e-2;
  std::printf("    outputs: ours vs FlashMLA rel-L2 %.3e, max |out diff| %.3e, max |lse diff| %.3e; "
              "mean |out| %.4f%s\n", rel_l2, max_diff, lse_diff, abs_sum / b.size(),
              !finite ? "; NON-FINITE" : ok ? "" : "; MISMATCH");
  return ok;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// Times both decodes interleaved, so that both see the same states of the card (its clock moves with its power
// draw under back-to-back load: docs/PERF.md session 37): `per call`, 100 rounds of one timed call each after a
// 256 MB write that evicts L2, the order alternating between rounds; `loop`, 6 rounds of 50 back-to-back calls
// each, alternating likewise; then the same loops of the split-KV kernel alone (no combine), which splits the time
// between the two kernels.
void time_pair(const char* shape, Decode* decodes[2], void* flush, size_t flush_bytes) {
  const char* names[2] = {"FlashMLA", "ours"};
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  auto timed = [&](Decode& decode, int calls) {
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < calls; ++i) decode(0);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms * 1e3f / calls;
  };
  for (Decode* d : {decodes[0], decodes[1]})
    for (int i = 0; i < 10; ++i) (*d)(0);  // warm-up
  std::vector<float> per_call[2], loop[2], splitkv_loop[2], splitkv_per_call[2];
  for (int round = 0; round < 100; ++round) {
    for (int j = 0; j < 2; ++j) {
      const int who = (round + j) % 2;
      CHECK(cudaMemsetAsync(flush, round & 0xff, flush_bytes));
      per_call[who].push_back(timed(*decodes[who], 1));
    }
  }
  for (int round = 0; round < 6; ++round)
    for (int j = 0; j < 2; ++j) {
      const int who = (round + j) % 2;
      loop[who].push_back(timed(*decodes[who], 50));
    }
  const char* barrier_env = std::getenv("SPLITKV_LOOP_BARRIER");
  const bool barrier = barrier_env && std::string(barrier_env) == "1";
  const std::function<void(cudaStream_t)> after_splitkv = [barrier](cudaStream_t stream) {
    if (barrier) empty_kernel<<<1, 32, 0, stream>>>();
  };
  Decode splitkv_looped[2] = {{decodes[0]->splitkv, after_splitkv}, {decodes[1]->splitkv, after_splitkv}};
  Decode splitkv_only[2] = {{decodes[0]->splitkv, [](cudaStream_t) {}}, {decodes[1]->splitkv, [](cudaStream_t) {}}};
  for (int round = 0; round < 6; ++round)
    for (int j = 0; j < 2; ++j) {
      const int who = (round + j) % 2;
      splitkv_loop[who].push_back(timed(splitkv_looped[who], 50));
    }
  for (int round = 0; round < 100; ++round)
    for (int j = 0; j < 2; ++j) {
      const int who = (round + j) % 2;
      CHECK(cudaMemsetAsync(flush, round & 0xff, flush_bytes));
      splitkv_per_call[who].push_back(timed(splitkv_only[who], 1));
    }
  CHECK(cudaGetLastError());
  for (int who = 0; who < 2; ++who) {
    const auto& pc = per_call[who];
    const double mean = std::accumulate(pc.begin(), pc.end(), 0.0) / pc.size();
    std::printf("%-3s %-9s per call median %7.1f mean %7.1f min %7.1f us;  loop median %7.1f (%.1f-%.1f) us;"
                "  split-KV kernel alone, loop median %7.1f us, per call median %7.1f us\n",
                shape, names[who], median(pc), mean, *std::min_element(pc.begin(), pc.end()), median(loop[who]),
                *std::min_element(loop[who].begin(), loop[who].end()),
                *std::max_element(loop[who].begin(), loop[who].end()), median(splitkv_loop[who]),
                median(splitkv_per_call[who]));
  }
  std::fflush(stdout);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

struct Shape {
  std::string name;
  int b, s_k, s_q, h_q;
  bool causal, varlen;
};

// A shape by name: M1, C1, C2 (batch 128, s_k 8192), or b<batch>s<s_k>h<h_q>q<s_q> with a "c" for causal and a "v"
// for varlen (lengths uniform in [1, 2 s_k - 1], a fixed draw), e.g. b4s16384h128q1 or b64s4096h16q2c.
bool parse_shape(const std::string& name, Shape& shape) {
  const Shape named[] = {{"M1", 128, 8192, 1, 16, false, false},
                         {"C1", 128, 8192, 1, 128, false, false},
                         {"C2", 128, 8192, 2, 128, true, false}};
  for (const Shape& s : named)
    if (s.name == name) return shape = s, true;
  char tail[8] = {};
  shape = {name, 0, 0, 0, 0, false, false};
  const int got = std::sscanf(name.c_str(), "b%ds%dh%dq%d%7s", &shape.b, &shape.s_k, &shape.h_q, &shape.s_q, tail);
  if (got < 4 || shape.b < 1 || shape.s_k < 1 || shape.h_q < 1 || shape.h_q > 128 || shape.s_q < 1) return false;
  for (const char* t = tail; *t; ++t) {
    if (*t == 'c') shape.causal = true;
    else if (*t == 'v') shape.varlen = true;
    else return false;
  }
  return shape.s_q * shape.h_q <= 1024;
}

std::vector<int> shape_lengths(const Shape& shape) {
  std::vector<int> lens(shape.b, shape.s_k);
  if (shape.varlen) {
    std::mt19937 rng(11);
    std::uniform_int_distribution<int> len(1, 2 * shape.s_k - 1);
    for (int& l : lens) l = std::max(len(rng), shape.s_q);
  }
  return lens;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string wanted = argc > 1 ? argv[1] : "M1,C1,C2";
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 2;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("[flashmla_anchor] %s, %d SMs; h_kv 1; FlashMLA and ours interleaved, %d time(s)\n", prop.name,
              prop.multiProcessorCount, repeats);
  if (!check_small_case(prop.multiProcessorCount)) return 1;
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = device_alloc<char>(flush_bytes);
  std::stringstream list(wanted);
  for (std::string name; std::getline(list, name, ',');) {
    Shape shape;
    if (!parse_shape(name, shape)) {
      std::fprintf(stderr, "unknown shape %s (M1, C1, C2 or b<batch>s<s_k>h<h_q>q<s_q>[c][v])\n", name.c_str());
      return 2;
    }
    Problem p(shape_lengths(shape), shape.s_q, shape.h_q, shape.causal, prop.multiProcessorCount, 1);
    Decode fmla = flashmla_bf16_decode(p.in, p.fmla), ours = our_bf16_decode(p.in, p.ours);
    fmla(0);
    ours(0);
    CHECK(cudaDeviceSynchronize());
    std::printf("%s: batch %d, s_k %d%s, h_q %d, s_q %d%s\n", shape.name.c_str(), shape.b, shape.s_k,
                shape.varlen ? " (varlen, mean)" : "", shape.h_q, shape.s_q, shape.causal ? ", causal" : "");
    if (!compare_outputs(p)) return 1;
    Decode* decodes[2] = {&fmla, &ours};
    for (int r = 0; r < repeats; ++r) time_pair(shape.name.c_str(), decodes, flush, flush_bytes);
  }
  cudaFree(flush);
  return 0;
}
