"""Shared machinery of the package's JAX primitives.

Each primitive lowers to an XLA FFI custom call on CUDA when the kernel for it was built and every CUDA device is a
Hopper (sm_90) part, and to the pure-jnp reference everywhere else. `implementation` is a static parameter of every
primitive: "auto" picks as above, "reference" always lowers to jnp, "kernel" insists on the FFI kernel.
"""

from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _ffi

IMPLEMENTATIONS = ("auto", "kernel", "reference")
FORCE_REFERENCE_ENV = "JAX_FLASH_MLA_FORCE_REFERENCE"


def resolve_implementation(implementation: str) -> str:
    """Validates `implementation`; the environment variable turns "auto" into "reference"."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "auto" and os.environ.get(FORCE_REFERENCE_ENV, "0") not in ("", "0"):
        return "reference"
    return implementation


def _cuda_capabilities():
    """The compute capabilities of this host's CUDA devices (None without a CUDA backend)."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    return [getattr(d, "compute_capability", None) for d in devices]


@functools.cache
def hopper_devices_only() -> bool:
    """True when CUDA devices exist and all of them are compute capability 9.0 (the kernels are built for sm_90a)."""
    capabilities = _cuda_capabilities()
    return bool(capabilities) and all(c == "9.0" for c in capabilities)


def cuda_kernel_usable(target_available: bool) -> bool:
    return target_available and hopper_devices_only()


class KernelFallbackWarning(UserWarning):
    """A computation lowered for CUDA runs the pure-jnp reference under implementation="auto": no kernel is usable."""


def _no_kernel_reason(target_available: bool) -> str:
    if not _ffi.extension_available():
        return f"the CUDA extension is not loaded: {_ffi.unavailable_reason()}"
    if not target_available:
        return f"this build has kernels only for {sorted(_ffi.kernel_formats())}"
    capabilities = _cuda_capabilities()
    if capabilities is None:
        return "this host has no CUDA device (the computation is lowered here for CUDA devices elsewhere)"
    found = sorted(set(map(str, capabilities)))
    return f"the kernels need compute capability 9.0 (Hopper) on every CUDA device, found {found}"


def warn_kernel_fallback(target_available: bool) -> None:
    """Warns (once per reason) that a CUDA lowering under "auto" takes the reference, much slower than the kernels:
    a missing or CPU-only build on a Hopper host would otherwise pass for the fast path."""
    warnings.warn(f"jax_flash_mla: lowering for CUDA without a usable kernel ({_no_kernel_reason(target_available)}), "
                  "so the pure-jnp reference runs, far slower than the Hopper kernels; pass implementation="
                  "'reference' (or set JAX_FLASH_MLA_FORCE_REFERENCE=1) to choose it and silence this warning",
                  KernelFallbackWarning, stacklevel=2)


def sharding_free(ctx):
    """ctx with sharding-free operand types, for lowering a jnp body with mlir.lower_fun: under explicit sharding
    some jnp ops (cumsum, scatter) reject sharded operand types, and a primitive's body is single-device anyway."""
    return ctx.replace(avals_in=[jax.core.ShapedArray(a.shape, a.dtype, a.weak_type) for a in ctx.avals_in])


def _no_derivative(name):
    def jvp(primals, tangents, **params):
        raise NotImplementedError(f"{name} is a decode-only kernel and has no derivative; "
                                  "wrap its inputs in jax.lax.stop_gradient if they carry tangents")
    return jvp


def _batch_sequentially(prim):
    """vmap rule (unbatched operands have dim None): maps the primitive over the batched axis with lax.map (the kernels have no extra batch dim)."""
    def rule(args, dims, **params):
        mapped = [jnp.moveaxis(a, d, 0) for a, d in zip(args, dims) if d is not None]

        def one(xs):
            it = iter(xs)
            full = [a if d is None else next(it) for a, d in zip(args, dims)]
            return prim.bind(*full, **params)

        outs = lax.map(one, mapped)
        return outs, [0] * len(outs)
    return rule


def new_primitive(name: str, abstract_eval, what: str) -> Primitive:
    """A multiple-results primitive with eager dispatch, abstract evaluation, the sequential vmap rule and a jvp
    that says `what` has no derivative; the caller registers its lowerings."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))
    prim.def_abstract_eval(abstract_eval)
    batching.primitive_batchers[prim] = _batch_sequentially(prim)
    ad.primitive_jvps[prim] = _no_derivative(what)
    return prim


def make_primitive(name: str, abstract_eval, reference_fn, kernel_fn, kernel_available) -> Primitive:
    """Defines a multiple-results primitive.

    reference_fn(*args, **params) and kernel_fn(*args, **params) are jnp-traceable functions returning a tuple;
    kernel_available(**params) -> bool says whether the FFI target exists for these params.
    """
    prim = new_primitive(name, abstract_eval, name)

    def default_lowering(ctx, *args, **params):
        if params["implementation"] == "kernel":
            raise ValueError(f"{name}: implementation='kernel' needs a CUDA sm_90 device; "
                             f"this computation is lowered for {ctx.module_context.platforms}")
        return mlir.lower_fun(lambda *a: reference_fn(*a, **params), multiple_results=True)(sharding_free(ctx), *args)

    def cuda_lowering(ctx, *args, **params):
        implementation = params["implementation"]
        usable = cuda_kernel_usable(kernel_available(**params))
        if implementation == "kernel" and not usable:
            raise ValueError(f"{name}: implementation='kernel' but no kernel is usable here: "
                             f"{_no_kernel_reason(kernel_available(**params))}")
        if implementation == "auto" and not usable:
            warn_kernel_fallback(kernel_available(**params))
        fn = kernel_fn if (implementation != "reference" and usable) else reference_fn
        return mlir.lower_fun(lambda *a: fn(*a, **params), multiple_results=True)(sharding_free(ctx), *args)

    mlir.register_lowering(prim, default_lowering)
    mlir.register_lowering(prim, cuda_lowering, platform="cuda")
    return prim
