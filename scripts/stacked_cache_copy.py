"""Does a custom call read `cache[l]` of a layer-stacked cache in place under lax.scan? (README, "A model's layers in
one cache".) Builds a one-function XLA FFI target for the CPU (g++ and jaxlib's FFI headers), runs a scan over
layers that writes a token and hands the cache to the target, in both layouts, and prints what the compiled HLO
makes for the target's operand:

    python scripts/stacked_cache_copy.py

Stacked `[layers, num_blocks, ...]`: the operand is a dynamic-slice fusion, i.e. a copy of one layer's cache per
layer and step. Page-major `[num_blocks * layers, ...]`: the operand is the scan's carried buffer, updated in place.
"""

from __future__ import annotations

import ctypes
import pathlib
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = r"""
#include "xla/ffi/api/ffi.h"
namespace ffi = xla::ffi;
static ffi::Error ByteSumImpl(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::F32>> y) {
  const unsigned char* p = static_cast<const unsigned char*>(x.untyped_data());
  float sum = 0;
  for (size_t i = 0; i < x.size_bytes(); ++i) sum += p[i];
  y->typed_data()[0] = sum;
  return ffi::Error::Success();
}
XLA_FFI_DEFINE_HANDLER_SYMBOL(ByteSum, ByteSumImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>());
"""
LAYERS, BLOCKS, ROW = 4, 512, (64, 1, 656)


def build_target() -> None:
    work = pathlib.Path(tempfile.mkdtemp())
    (work / "byte_sum.cc").write_text(SOURCE)
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-std=c++17", "-w", f"-I{jax.ffi.include_dir()}",
                    str(work / "byte_sum.cc"), "-o", str(work / "byte_sum.so")], check=True)
    library = ctypes.cdll.LoadLibrary(str(work / "byte_sum.so"))
    jax.ffi.register_ffi_target("byte_sum", jax.ffi.pycapsule(library.ByteSum), platform="cpu")


def byte_sum(x):
    return jax.ffi.ffi_call("byte_sum", jax.ShapeDtypeStruct((1,), jnp.float32))(x)


def stacked_step(cache, new):
    def layer(c, xs):
        l, token = xs
        c = c.at[l, 3, 5].set(token)
        return c, byte_sum(c[l])
    return jax.lax.scan(layer, cache, (jnp.arange(LAYERS), new))


def page_major_step(cache, new):
    def layer(c, xs):
        l, token = xs
        c = c.at[3 * LAYERS + l, 5].set(token)
        return c, byte_sum(c)
    return jax.lax.scan(layer, cache, (jnp.arange(LAYERS), new))


LAYOUTS = {"stacked": (stacked_step, (LAYERS, BLOCKS) + ROW),
           "page-major": (page_major_step, (BLOCKS * LAYERS,) + ROW)}


def operand(layout: str):
    """(name, shape text) of the instruction that feeds the custom call in the layout's compiled step."""
    step, shape = LAYOUTS[layout]
    cpu = jax.devices("cpu")[0]  # the target is registered for the CPU (on a GPU machine too)
    cache = jax.device_put(np.zeros(shape, np.uint8), cpu)
    new = jax.device_put(np.ones((LAYERS,) + ROW[1:], np.uint8), cpu)
    hlo = jax.jit(step, donate_argnums=0).lower(cache, new).compile().as_text()
    call = re.search(r"custom-call\((%[\w.-]+)\), custom_call_target=\"byte_sum\"", hlo).group(1)
    return call, re.search(re.escape(call) + r" = (\w+\[[\d,]*\])", hlo).group(1)


def main() -> None:
    build_target()
    for layout, (_, shape) in LAYOUTS.items():
        name, operand_shape = operand(layout)
        print(f"{layout:<11} cache {shape}: the custom call's operand {name} of shape {operand_shape}")


if __name__ == "__main__":
    main()
