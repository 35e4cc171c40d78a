"""Loads the compiled extension `jax_flash_mla._jax_flash_mla`, registers its XLA FFI handlers for CUDA, and says
which kernels were built.

Without the extension (not built, or built with JAX_FLASH_MLA_CUDA=OFF) the package still works: every op runs
the pure-jnp reference. Registration for the CUDA platform is deferred by JAX until its CUDA plugin starts, so
importing this module never touches a GPU and works under JAX_PLATFORMS=cpu.

Set JAX_FLASH_MLA_DISABLE_KERNELS=1 to ignore the extension (reference-only), e.g. to compare both paths.
"""

from __future__ import annotations

import os
import re
import warnings

import jax

from .formats import KV_FORMATS, check_kv_format

TARGET_SCHED_META = "jax_flash_mla_sched_meta"
_DECODE_PREFIX = "jax_flash_mla_decode_"
DISABLE_ENV = "JAX_FLASH_MLA_DISABLE_KERNELS"


def _runtime_ffi_api_version():
    """(major, minor) of the XLA FFI API that the installed jaxlib implements, read from its own headers."""
    try:
        with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
            text = f.read()
    except (OSError, AttributeError):
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    return (int(major.group(1)), int(minor.group(1))) if major and minor else None


def _load():
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None, f"{DISABLE_ENV} is set"
    try:
        from jax_flash_mla import _jax_flash_mla as ext
    except ImportError as e:
        return None, f"extension not importable ({e})"
    built = tuple(ext.ffi_api_version())
    runtime = _runtime_ffi_api_version()
    # A handler built against FFI headers of version N only runs on a jaxlib whose runtime is >= N.
    if runtime is not None and built > runtime:
        warnings.warn(f"jax_flash_mla: extension built against XLA FFI API {built}, but the installed jaxlib "
                      f"implements {runtime}; using the jnp reference. Rebuild with this jaxlib "
                      f"(pip install --no-build-isolation .).", RuntimeWarning, stacklevel=3)
        return None, "FFI API version mismatch"
    return ext, None


_ext, _unavailable_reason = _load()
_registered = False


def _register_once() -> None:
    global _registered
    if _registered or _ext is None:
        return
    for name, capsule in _ext.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _registered = True


_register_once()

_TARGETS = frozenset(_ext.registrations()) if _ext is not None else frozenset()
_FORMATS = frozenset(_ext.kernel_formats()) if _ext is not None else frozenset()


def extension_available() -> bool:
    """True when the extension was built with CUDA, i.e. the scheduler kernel (and maybe decode kernels) exist."""
    return TARGET_SCHED_META in _TARGETS


def kernel_formats() -> frozenset:
    """Cache formats whose decode kernel was built and may be used (a subset of KV_FORMATS; empty without the CUDA
    extension)."""
    return _FORMATS


def unavailable_reason():
    """Why there are no kernels (None when the CUDA extension is loaded), for error messages."""
    if _ext is not None and not extension_available():
        return "extension built without CUDA (JAX_FLASH_MLA_CUDA=OFF or no CUDA >= 12.8 toolkit at build time)"
    return _unavailable_reason


def decode_target(kv_format, ds_scales: str = "group") -> str:
    """FFI target name of the decode kernel for `kv_format` (whether or not it was built: see kernel_formats); with
    ds_scales "token", fp8_ds_mla's design-S decoder."""
    kv_format = check_kv_format(kv_format)
    return _DECODE_PREFIX + kv_format + ("_token_scales" if ds_scales == "token" else "")


def all_targets() -> tuple:
    """Every FFI target name this package can emit (built here or not): the scheduler's and one decoder per format."""
    return (TARGET_SCHED_META,) + tuple(_DECODE_PREFIX + f for f in KV_FORMATS) + (
        decode_target("fp8_ds_mla", "token"),)


def build_info() -> dict:
    """How the loaded extension was built ({} without it): CUDA on/off, CUDA version, FFI API, formats."""
    return dict(_ext.build_info()) if _ext is not None else {}


__all__ = ["extension_available", "kernel_formats", "decode_target", "all_targets", "TARGET_SCHED_META",
           "unavailable_reason", "build_info"]
