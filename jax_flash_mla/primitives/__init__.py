"""JAX primitives of jax_flash_mla: one per op, each with abstract evaluation, FFI and reference lowerings."""

from .base import (FORCE_REFERENCE_ENV, IMPLEMENTATIONS, KernelFallbackWarning, hopper_devices_only,
                   resolve_implementation)
from .decode import decode_p
from .sched_meta import SCHED_META_INTS, sched_meta_p, schedule

__all__ = ["decode_p", "sched_meta_p", "schedule", "SCHED_META_INTS", "FORCE_REFERENCE_ENV", "IMPLEMENTATIONS",
           "KernelFallbackWarning", "hopper_devices_only", "resolve_implementation"]
