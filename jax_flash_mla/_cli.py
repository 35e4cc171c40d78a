"""Helpers shared by the `bench` and `accuracy` command-line tools: per-format inputs, flags, output files."""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
import sys

import jax
import jax.numpy as jnp

from .quant import quantize_kv_cache

FP8_MAX = 448.0  # largest float8_e4m3fn value


@functools.partial(jax.jit, static_argnums=(0, 3))
def format_inputs(kv_format, q, latent, ds_scales="group"):
    """(q, cache, descales) of `kv_format` from bf16 q and latent.

    fp8_per_tensor descales are amax / 448 of q and of the latent, as a serving loop with calibrated amax picks them
    (the convention of `python -m jax_flash_mla`); the other formats take q as it is and no descales. With
    ds_scales="token", fp8_ds_mla's cache carries one scale per token (for its design-S decoder).
    """
    if kv_format == "fp8_ds_mla":
        return q, quantize_kv_cache(latent, kv_format, ds_scales=ds_scales), {}
    if kv_format != "fp8_per_tensor":
        return q, quantize_kv_cache(latent, kv_format), {}
    descale_q = jnp.max(jnp.abs(q.astype(jnp.float32))) / FP8_MAX
    descale_k = jnp.max(jnp.abs(latent.astype(jnp.float32))) / FP8_MAX
    q8 = jnp.clip(q.astype(jnp.float32) / descale_q, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q8, quantize_kv_cache(latent, kv_format, scale=descale_k), {"descale_q": descale_q,
                                                                       "descale_k": descale_k}


def positive_int(text):
    """argparse type for a count: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def sized(given, quick: bool, small, full):
    """A size flag's value: as given, else the --quick or the full default."""
    return given if given is not None else small if quick else full


def list_flag(allowed, flag):
    """argparse type for a comma-separated subset of `allowed` (kept in the order given)."""
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [s for s in items if s not in allowed]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"{flag} takes a comma list of {','.join(allowed)}, got {text!r}")
        return items
    return parse


def output_path(given, name) -> str:
    """`given`, else `name` under $OUT when that is set, else in the cwd."""
    return given or os.path.join(os.environ.get("OUT") or ".", name)


def write_csv(rows, path, columns):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def pyplot():
    """matplotlib.pyplot on a file-only backend, or None (saying so on stderr) when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no PNG written", file=sys.stderr)
        return None
    return plt


def fmt(x, spec) -> str:
    """`x` formatted with `spec`, or "-" for None / NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
