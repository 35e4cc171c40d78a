// The Python extension jax_flash_mla._jax_flash_mla: hands the FFI handlers to
// jax_flash_mla/_ffi.py, which registers them for the CUDA platform. A build
// without CUDA (JAX_FLASH_MLA_CUDA=OFF) still produces this module, with no
// handlers, so the package can tell "not built" from "built reference-only".

#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "xla/ffi/api/c_api.h"

#ifdef JAX_FLASH_MLA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "ffi/handlers.h"
#endif
#ifdef JAX_FLASH_MLA_EVENT_TRACE
#include "kernels/event_trace.h"
#endif

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule handler_capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// FFI target name -> PyCapsule of its XLA_FFI_Handler.
nb::dict registrations() {
  nb::dict d;
#ifdef JAX_FLASH_MLA_HAS_CUDA
  d["jax_flash_mla_sched_meta"] = handler_capsule(JaxFlashMlaSchedMeta);
#endif
#ifdef JAX_FLASH_MLA_HAS_BF16
  d["jax_flash_mla_decode_bf16"] = handler_capsule(JaxFlashMlaDecodeBf16);
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_PER_TENSOR
  d["jax_flash_mla_decode_fp8_per_tensor"] = handler_capsule(JaxFlashMlaDecodeFp8PerTensor);
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_DS_MLA
  d["jax_flash_mla_decode_fp8_ds_mla"] = handler_capsule(JaxFlashMlaDecodeFp8DsMla);
  d["jax_flash_mla_decode_fp8_ds_mla_token_scales"] = handler_capsule(JaxFlashMlaDecodeFp8DsMlaTokenScales);
#endif
  return d;
}

// Cache formats with a decode kernel in this build.
nb::list kernel_formats() {
  nb::list formats;
#ifdef JAX_FLASH_MLA_HAS_BF16
  formats.append("bf16");
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_PER_TENSOR
  formats.append("fp8_per_tensor");
#endif
#ifdef JAX_FLASH_MLA_HAS_FP8_DS_MLA
  formats.append("fp8_ds_mla");
#endif
  return formats;
}

nb::dict build_info() {
  nb::dict info;
#ifdef JAX_FLASH_MLA_HAS_CUDA
  info["cuda"] = true;
  info["cuda_runtime_version"] = CUDART_VERSION;
#else
  info["cuda"] = false;
#endif
#ifdef JAX_FLASH_MLA_DISABLE_FP8
  info["fp8_disabled"] = true;
#else
  info["fp8_disabled"] = false;
#endif
  info["ffi_api_version"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAX_FLASH_MLA_EVENT_TRACE
  info["event_trace"] = true;
#else
  info["event_trace"] = false;
#endif
  info["kernel_formats"] = kernel_formats();
  return info;
}

}  // namespace

NB_MODULE(_jax_flash_mla, m) {
  m.doc() = "XLA FFI handlers of jax_flash_mla (MLA paged decode on Hopper)";
  m.def("registrations", &registrations, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");
  m.def("kernel_formats", &kernel_formats, "Cache formats whose decode kernel was built.");
  m.def("ffi_api_version", []() { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "(major, minor) of the XLA FFI headers this module was built against.");
  m.def("build_info", &build_info, "How this module was built.");
#ifdef JAX_FLASH_MLA_EVENT_TRACE
  namespace trace = jax_flash_mla::event_trace;
  m.def("event_trace_arm", &trace::arm, "Allocate (once) and zero the decode kernel's event-trace buffer.");
  m.def(
      "event_trace_read",
      []() {
        const std::vector<uint64_t> words = trace::read();
        return nb::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(uint64_t));
      },
      "The event-trace buffer as bytes of uint64 words (kernels/event_trace.h has the layout).");
  m.attr("EVENT_TRACE_SHAPE") =
      nb::make_tuple(trace::kCtas, trace::kRoles, trace::kPages, trace::kEvents, trace::kClockWords);
#endif
}
