// The two bf16 decodes that main.cu times on the same inputs: FlashMLA's (flashmla_side.cu, compiled against a
// FlashMLA checkout) and ours (our_side.cu, compiled against cpp/). Each side sees only its own headers (both
// projects have a params.h); this interface is all they share.
#pragma once

#include <functional>

#include <cuda_runtime.h>

// MLA's shapes, the same for both sides: 576 channels of q and K (512 latent + 64 RoPE), V = the first 512, pages
// of 64 tokens.
constexpr int kHeadDim = 576, kHeadDimV = 512, kPage = 64;

// One decode problem with h_kv = 1: q [b, s_q, h_q, 576] and the cache [b * max_pages, 64, 1, 576] bf16, the
// block table [b, max_pages] int32 and the lengths [b] int32, all on the device.
struct DecodeInputs {
  int b, s_q, h_q, max_pages;
  bool causal;
  float softmax_scale;
  const void* q;
  const void* k_cache;
  const int* block_table;
  const int* seqlens;
  int num_sms;
};

// Where a decode writes: out [b, s_q, h_q, 512] bf16 (both kernels' layout for h_kv = 1) and lse float32 (natural
// log) in the kernel's own order: FlashMLA's [b, s_q, h_q], ours [b, h_q, s_q] (main.cu reads each its way).
struct DecodeOutputs {
  void* out;
  float* lse;
};

// Device scratch of a prepared decode: its scheduler metadata (`parts` rows of the side's own type) and split
// counts, and the split-KV partials of `partial_rows` rows (splits x query rows) of 512 channels. Freed with the
// last copy of the Decode that holds it.
template <typename SchedMetaT>
struct DecodeScratch {
  SchedMetaT* meta = nullptr;
  int* num_splits = nullptr;
  float *lse_accum = nullptr, *o_accum = nullptr;
  DecodeScratch(int parts, int batch, size_t partial_rows) {
    cudaMalloc(&meta, parts * sizeof(SchedMetaT));
    cudaMalloc(&num_splits, (batch + 1) * sizeof(int));
    cudaMalloc(&lse_accum, partial_rows * sizeof(float));
    cudaMalloc(&o_accum, partial_rows * kHeadDimV * sizeof(float));
  }
  ~DecodeScratch() {
    cudaFree(meta);
    cudaFree(num_splits);
    cudaFree(lse_accum);
    cudaFree(o_accum);
  }
};

// A prepared decode: its scheduler metadata computed once (FlashMLA's benchmark also leaves get_mla_metadata out of
// the timing), its scratch allocated; a call runs the split-KV kernel and then the combine on the stream.
struct Decode {
  std::function<void(cudaStream_t)> splitkv, combine;
  void operator()(cudaStream_t stream) const {
    splitkv(stream);
    combine(stream);
  }
};

Decode flashmla_bf16_decode(const DecodeInputs& in, const DecodeOutputs& out);
Decode our_bf16_decode(const DecodeInputs& in, const DecodeOutputs& out);
