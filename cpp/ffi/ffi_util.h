// Helpers shared by the FFI handlers: checks of an ffi::AnyBuffer's dtype,
// rank and dims, with messages that name the operand and show both shapes
// (host-side metadata only; no device data is read), and launcher calls that
// turn CUDA errors and C++ exceptions into ffi::Error (nothing may unwind
// through the C ABI of a handler).
#pragma once

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

namespace jax_flash_mla::ffi_util {

namespace ffi = ::xla::ffi;

// Matches any size in a dims pattern.
inline constexpr int64_t kAnyDim = -1;

inline std::string_view dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    default: return "an unsupported dtype";
  }
}

template <typename Dims>
std::string shape_str(const Dims& dims) {
  std::string s = "[";
  bool first = true;
  for (int64_t d : dims) {
    if (!first) s += ", ";
    s += d == kAnyDim ? std::string("*") : std::to_string(d);
    first = false;
  }
  return s + "]";
}

// `name` must have dtype `want` (or `also`, when given).
inline ffi::Error check_dtype(const ffi::AnyBuffer& buf, std::string_view name, ffi::DataType want,
                              ffi::DataType also = ffi::DataType::INVALID) {
  const ffi::DataType got = buf.element_type();
  if (got == want || (also != ffi::DataType::INVALID && got == also)) return ffi::Error::Success();
  std::string msg = "jax_flash_mla: ";
  msg.append(name).append(" must be ").append(dtype_name(want));
  if (also != ffi::DataType::INVALID) msg.append(" or ").append(dtype_name(also));
  msg.append(", got ").append(dtype_name(got));
  return ffi::Error::InvalidArgument(std::move(msg));
}

// `name` must have exactly the dims of `want` (kAnyDim matches any size).
inline ffi::Error check_shape(const ffi::AnyBuffer& buf, std::string_view name, std::initializer_list<int64_t> want,
                              std::string_view layout = {}) {
  const auto got = buf.dimensions();
  bool ok = got.size() == want.size();
  if (ok) {
    size_t i = 0;
    for (int64_t w : want) {
      if (w != kAnyDim && got[i] != w) ok = false;
      ++i;
    }
  }
  if (ok) return ffi::Error::Success();
  std::string msg = "jax_flash_mla: ";
  msg.append(name).append(" must have shape ").append(shape_str(want));
  if (!layout.empty()) msg.append(" ").append(layout);
  msg.append(", got ").append(shape_str(got));
  return ffi::Error::InvalidArgument(std::move(msg));
}

// dtype and shape together.
inline ffi::Error check_buffer(const ffi::AnyBuffer& buf, std::string_view name, ffi::DataType dtype,
                               std::initializer_list<int64_t> dims, std::string_view layout = {}) {
  if (ffi::Error e = check_dtype(buf, name, dtype); e.failure()) return e;
  return check_shape(buf, name, dims, layout);
}

// A float32 device scalar given as shape [] or [1].
inline ffi::Error check_f32_scalar(const ffi::AnyBuffer& buf, std::string_view name) {
  if (ffi::Error e = check_dtype(buf, name, ffi::DataType::F32); e.failure()) return e;
  const auto dims = buf.dimensions();
  if (dims.size() == 0 || (dims.size() == 1 && dims[0] == 1)) return ffi::Error::Success();
  std::string msg = "jax_flash_mla: ";
  msg.append(name).append(" must be a float32 scalar of shape [] or [1], got ").append(shape_str(dims));
  return ffi::Error::InvalidArgument(std::move(msg));
}

// A dimension that the kernels keep in an int.
inline ffi::Error check_fits_int(int64_t value, std::string_view what) {
  if (value >= 0 && value <= INT32_MAX) return ffi::Error::Success();
  std::string msg = "jax_flash_mla: ";
  msg.append(what).append(" = ").append(std::to_string(value)).append(" does not fit in int32");
  return ffi::Error::InvalidArgument(std::move(msg));
}

// Reports (and clears) the CUDA error of the launches just made.
inline ffi::Error last_cuda_error(std::string_view what) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return ffi::Error::Success();
  std::string msg = "jax_flash_mla: ";
  msg.append(what).append(" failed: ").append(cudaGetErrorName(err)).append(": ").append(cudaGetErrorString(err));
  return ffi::Error::Internal(std::move(msg));
}

// Runs a kernel launcher, then reports its exception or pending CUDA error.
template <typename Launch>
ffi::Error launch(std::string_view what, Launch&& run) {
  try {
    run();
  } catch (const std::exception& e) {
    std::string msg = "jax_flash_mla: ";
    msg.append(what).append(" failed: ").append(e.what());
    return ffi::Error::Internal(std::move(msg));
  } catch (...) {
    std::string msg = "jax_flash_mla: ";
    msg.append(what).append(" failed with an unknown exception");
    return ffi::Error::Internal(std::move(msg));
  }
  return last_cuda_error(what);
}

}  // namespace jax_flash_mla::ffi_util

// Returns from the enclosing handler when `expr` yields a failed ffi::Error.
#define JFM_RETURN_IF_ERROR(expr)                       \
  do {                                                  \
    if (::xla::ffi::Error jfm_err_ = (expr); jfm_err_.failure()) \
      return jfm_err_;                                  \
  } while (0)
