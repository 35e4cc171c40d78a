"""Does a custom call read `cache[l]` of a layer-stacked cache in place under lax.scan? (README, "A model's layers in
one cache".) Builds a one-function XLA FFI target for the CPU (g++ and jaxlib's FFI headers), runs a scan over
layers that writes a token and hands the cache to the target, in both layouts, and prints what the compiled HLO
makes for the target's operand:

    PYTHONPATH=. python scripts/stacked_cache_copy.py     # from the repo root (or with the package installed)

Stacked `[layers, num_blocks, ...]` read as `cache[l]`: the operand is a dynamic-slice fusion, i.e. a copy of one
layer's cache per layer and step. The same stack with its leading dimensions merged (what `layer=` hands the kernel)
and a page-major `[num_blocks * layers, ...]` cache: the operand is the scan's carried buffer, updated in place
(through a bitcast). Where a Hopper kernel is usable it does the same with the bf16 decode itself on the GPU (XLA:GPU
compiles it), reporting what feeds the kernel's k_cache operand.
"""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash_mla as fm
from jax_flash_mla import _ffi, hlo

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


def stacked_merged_step(cache, new):
    def layer(c, xs):
        l, token = xs
        c = c.at[l, 3, 5].set(token)
        return c, byte_sum(c.reshape((LAYERS * BLOCKS,) + ROW))
    return jax.lax.scan(layer, cache, (jnp.arange(LAYERS), new))


def page_major_step(cache, new):
    def layer(c, xs):
        l, token = xs
        c = c.at[3 * LAYERS + l, 5].set(token)
        return c, byte_sum(c)
    return jax.lax.scan(layer, cache, (jnp.arange(LAYERS), new))


LAYOUTS = {"stacked": (stacked_step, (LAYERS, BLOCKS) + ROW),
           "stacked-merged": (stacked_merged_step, (LAYERS, BLOCKS) + ROW),
           "page-major": (page_major_step, (BLOCKS * LAYERS,) + ROW)}


def operand(layout: str):
    """What feeds the test target in the layout's compiled step on the CPU."""
    step, shape = LAYOUTS[layout]
    cpu = jax.devices("cpu")[0]  # the target is registered for the CPU (on a GPU machine too)
    cache = jax.device_put(np.zeros(shape, np.uint8), cpu)
    new = jax.device_put(np.ones((LAYERS,) + ROW[1:], np.uint8), cpu)
    return hlo.custom_call_operand(jax.jit(step, donate_argnums=0).lower(cache, new).compile(), "byte_sum", 0)


def decode_operand(layout: str):
    """What feeds the bf16 decode kernel's k_cache in the layout's compiled step (a scan that writes a token into
    each layer's cache and attends over it), compiled for the default device: [(name, shape), ...] from the
    kernel's operand out through the computations that wrap it (XLA:GPU's command buffers) and bitcasts, and the
    opcode of the last: a fusion computes a copy, a parameter or get-tuple-element is the scan's carried buffer."""
    blocks, b, h_q = 64, 4, 16
    table = jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2)
    seqlens = jnp.full((b,), 100, jnp.int32)
    q = jnp.ones((LAYERS, b, 1, h_q, 576), jnp.bfloat16)
    new = jnp.ones((LAYERS, b, 1, 1, 576), jnp.bfloat16)
    meta = fm.get_mla_metadata(seqlens, h_q, 1)

    def step(cache):
        def layer(c, xs):
            l, q_l, kv = xs
            if layout == "page-major":
                rows = table * LAYERS + l
                c = fm.write_kv_cache(c, kv, rows, seqlens[:, None] - 1, "bf16")
                out, _ = fm.flash_mla_with_kvcache(q_l, c, rows, seqlens, 512, meta, implementation="kernel")
            else:
                c = fm.write_kv_cache(c, kv, table, seqlens[:, None] - 1, "bf16", layer=l)
                read = (c[l], None) if layout == "stacked" else (c, l)  # stacked-merged: layer=
                out, _ = fm.flash_mla_with_kvcache(q_l, read[0], table, seqlens, 512, meta, layer=read[1],
                                                   implementation="kernel")
            return c, out
        return jax.lax.scan(layer, cache, (jnp.arange(LAYERS), q, new))

    shape = (blocks * LAYERS, 64, 1, 576) if layout == "page-major" else (LAYERS, blocks, 64, 1, 576)
    compiled = jax.jit(step, donate_argnums=0).lower(jnp.zeros(shape, jnp.bfloat16)).compile()
    chain = hlo.custom_call_operand_chain(compiled, _ffi.decode_target("bf16"), 1)
    return chain, hlo.opcode(compiled, chain[-1][0])


def main() -> None:
    build_target()
    for layout, (_, shape) in LAYOUTS.items():
        name, operand_shape = operand(layout)
        print(f"{layout:<15} cache {shape}: the custom call's operand {name} of shape {operand_shape}")
    if "bf16" in fm.kernel_formats():
        for layout in LAYOUTS:
            chain, source = decode_operand(layout)
            path = " <- ".join(f"{name} {shape}" for name, shape in chain)
            print(f"{layout:<15} bf16 decode on {jax.devices()[0].device_kind}: k_cache is {path} ({source})")


if __name__ == "__main__":
    main()
