"""Accuracy of every cache format and path against a float64 oracle: `python -m jax_flash_mla.accuracy`.

For each data set of shared README §4 (gaussian; RoPE outliers: 8 RoPE channels ×20 in K and ×5 in q; small latent:
NoPE ×0.05 in K) it draws a bf16 latent cache and bf16 queries; the truth is their attention computed in float64
(NumPy). Each format then quantizes them (fp8_per_tensor: descales = amax / 448 of q and of the cache, as calibrated
serving would pick them) and every available path — the Hopper kernel where `kernel_formats()` has the format, the
jnp reference always — is scored by the rel-L2 of out and the max |Δlse| against the truth. Beside them stands the
format's quantization floor: the float64 attention over the dequantized cache (and dequantized q for
fp8_per_tensor), i.e. the error the format alone causes, and README §4's numbers, so that a regression stands out.
The table is printed last; a CSV and a PNG chart (if matplotlib is importable) go under $OUT, else the cwd.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import KV_FORMATS, PAGE_SIZE, dequantize_kv_cache, flash_mla_with_kvcache, get_mla_metadata, kernel_formats
from ._cli import fmt, format_inputs, list_flag, output_path, positive_int, pyplot, sized, write_csv
from .formats import HEAD_DIM_QK, HEAD_DIM_V

SOFTMAX_SCALE = HEAD_DIM_QK ** -0.5
DATASETS = ("gaussian", "rope_outliers", "small_latent")

# Shared README §4 (rel-L2 of out against float64; 4096 tokens, 64 heads). Emulation of the quantization alone; for
# fp8_ds_mla with q and P in bf16, and (second table) with q in e4m3 per 128 channels and P in e4m3.
README_EMULATION = {
    "bf16": {"gaussian": 8.5e-4, "rope_outliers": 4.3e-4, "small_latent": 1.8e-3},
    "fp8_per_tensor": {"gaussian": 3.7e-2, "rope_outliers": 2.4e-1, "small_latent": 4.2e-2},
    "fp8_ds_mla": {"gaussian": 2.0e-2, "rope_outliers": 2.8e-2, "small_latent": 2.8e-2},
}
README_EMULATION_FP8_Q_P = {"fp8_ds_mla": {"gaussian": 3.5e-2, "rope_outliers": 3.0e-2, "small_latent": 3.9e-2}}
# Measured on an H200 (b 16, h_q 64, s_k 4096): FlashMLA's BF16 kernel and PR #54's per-tensor FP8 kernel.
README_KERNEL = {
    "bf16": {"gaussian": 1.8e-3, "rope_outliers": 1.6e-3, "small_latent": 2.3e-3},
    "fp8_per_tensor": {"gaussian": 3.5e-2, "rope_outliers": 2.3e-1, "small_latent": 3.9e-2},
}
# A rel-L2 more than this many times the largest README figure of its (format, data set) is flagged.
REGRESSION_FACTOR = 1.5

CSV_COLUMNS = ("dataset", "format", "path", "batch", "seqlen", "heads_q", "num_sms", "rel_l2", "max_abs_dlse",
               "floor_rel_l2", "floor_max_abs_dlse", "readme_emulation", "readme_emulation_fp8_q_p", "readme_kernel",
               "ratio_to_readme")


def make_dataset(rng, dataset, batch, seqlen, heads):
    """bf16 q [b, heads, 576] and per-sequence latent tokens [b, seqlen, 576] of a README §4 data set."""
    tokens = rng.standard_normal((batch, seqlen, HEAD_DIM_QK), dtype=np.float32)
    q = rng.standard_normal((batch, heads, HEAD_DIM_QK), dtype=np.float32)
    if dataset == "rope_outliers":
        tokens[..., HEAD_DIM_V:HEAD_DIM_V + 8] *= 20
        q[..., HEAD_DIM_V:HEAD_DIM_V + 8] *= 5
    elif dataset == "small_latent":
        tokens[..., :HEAD_DIM_V] *= 0.05
    return q.astype(ml_dtypes.bfloat16), tokens.astype(ml_dtypes.bfloat16)


def page_tokens(rng, tokens):
    """Scatters tokens [b, seqlen, 576] into a shuffled page pool [b * pages, 64, 1, 576]; returns (pool, table)."""
    batch, seqlen, dim = tokens.shape
    pages = seqlen // PAGE_SIZE
    table = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    pool = np.empty((batch * pages, PAGE_SIZE, 1, dim), tokens.dtype)
    pool[table.reshape(-1)] = tokens.reshape(batch * pages, PAGE_SIZE, 1, dim)
    return pool, table


def attention_f64(q, tokens):
    """Float64 attention of q [b, h, 576] over every token of tokens [b, t, 576]: out [b, h, 512], lse [b, h]."""
    q = np.asarray(q, np.float64)
    tokens = np.asarray(tokens, np.float64)
    logits = SOFTMAX_SCALE * (q @ tokens.transpose(0, 2, 1))
    peak = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=-1, keepdims=True)
    return (weights / total) @ tokens[..., :HEAD_DIM_V], (np.log(total) + peak)[..., 0]


def rel_l2(x, ref) -> float:
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def max_abs_diff(x, ref) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


@functools.partial(jax.jit, static_argnames=("kv_format", "implementation"))
def _decode(q, cache, table, seqlens, meta, scales, *, kv_format, implementation):
    return flash_mla_with_kvcache(q, cache, table, seqlens, HEAD_DIM_V, meta, kv_format=kv_format,
                                  implementation=implementation, **scales)


def _readme_figures(kv_format, dataset):
    return tuple(table.get(kv_format, {}).get(dataset, math.nan)
                 for table in (README_EMULATION, README_EMULATION_FP8_Q_P, README_KERNEL))


def evaluate(datasets, kv_formats, *, batch, seqlen, heads, seed, num_sms=None):
    """Scores every (data set, format, path); returns one dict per row with the keys of CSV_COLUMNS."""
    usable = kernel_formats()
    rows = []
    for index, dataset in enumerate(datasets):
        rng = np.random.default_rng([seed, index])
        q, tokens = make_dataset(rng, dataset, batch, seqlen, heads)
        true_out, true_lse = attention_f64(q, tokens)
        pool, table = page_tokens(rng, tokens)
        seqlens = jnp.full((batch,), seqlen, jnp.int32)
        meta = get_mla_metadata(seqlens, heads, 1, num_sms=num_sms)
        q4 = q[:, None]  # [b, s_q = 1, h, 576]
        for kv_format in kv_formats:
            q_in, cache, scales = format_inputs(kv_format, q4, pool)
            descale_k = scales.get("descale_k")
            dequantized = np.asarray(dequantize_kv_cache(cache, kv_format, scale=descale_k, dtype=jnp.float32))
            q_floor = np.asarray(q_in, np.float64)[:, 0]
            if kv_format == "fp8_per_tensor":
                q_floor = q_floor * float(scales["descale_q"])
            floor_out, floor_lse = attention_f64(q_floor, dequantized[table].reshape(batch, seqlen, HEAD_DIM_QK))
            emulation, emulation_q_p, kernel = _readme_figures(kv_format, dataset)
            bound = np.nanmax([emulation, emulation_q_p, kernel])
            paths = (["kernel"] if kv_format in usable else []) + ["reference"]
            for path in paths:
                out, lse = _decode(q_in, cache, jnp.asarray(table), seqlens, meta, scales, kv_format=kv_format,
                                   implementation=path)
                error = rel_l2(out[:, 0], true_out)
                rows.append(dict(
                    dataset=dataset, format=kv_format, path=path, batch=batch, seqlen=seqlen, heads_q=heads,
                    num_sms="device" if num_sms is None else num_sms,
                    rel_l2=error, max_abs_dlse=max_abs_diff(lse[:, :, 0], true_lse),
                    floor_rel_l2=rel_l2(floor_out, true_out), floor_max_abs_dlse=max_abs_diff(floor_lse, true_lse),
                    readme_emulation=emulation, readme_emulation_fp8_q_p=emulation_q_p, readme_kernel=kernel,
                    ratio_to_readme=error / bound))
                print(f"[accuracy] {dataset} {kv_format} {path}: rel-L2 {error:.2e}", file=sys.stderr, flush=True)
            del q_in, cache, dequantized
    return rows


# Table columns: header, width, row key, format.
TABLE = (("rel-L2", 9, "rel_l2", ".1e"), ("max|dlse|", 11, "max_abs_dlse", ".1e"), ("floor", 9, "floor_rel_l2", ".1e"),
         ("floor dlse", 11, "floor_max_abs_dlse", ".1e"), ("README emu", 12, "readme_emulation", ".1e"),
         ("emu q,P e4m3", 13, "readme_emulation_fp8_q_p", ".1e"), ("README krnl", 12, "readme_kernel", ".1e"),
         ("x README", 10, "ratio_to_readme", ".2f"))


def print_table(rows):
    print(f"{'data':<14}{'format':<16}{'path':<11}" + "".join(f"{h:>{w}}" for h, w, _, _ in TABLE))
    for r in rows:
        flag = " !" if r["ratio_to_readme"] > REGRESSION_FACTOR else ""
        print(f"{r['dataset']:<14}{r['format']:<16}{r['path']:<11}"
              + "".join(f"{fmt(r[key], spec):>{w}}" for _, w, key, spec in TABLE) + flag)


def plot(rows, path) -> bool:
    """One panel per data set: rel-L2 of each (format, path) and of the format's floor, log scale."""
    plt = pyplot()
    if plt is None:
        return False
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        subset = [r for r in rows if r["dataset"] == dataset]
        labels = [f"{r['format']}\n{r['path']}" for r in subset]
        x = np.arange(len(subset))
        ax.bar(x - 0.2, [r["rel_l2"] for r in subset], 0.4, label="rel-L2")
        # A zero floor (bf16: the cache is the truth) has no bar on the log axis.
        ax.bar(x + 0.2, [r["floor_rel_l2"] or math.nan for r in subset], 0.4, label="quantization floor")
        ax.scatter(x, [r["readme_emulation"] for r in subset], marker="_", s=300, color="k", label="README emulation")
        ax.scatter(x, [r["readme_kernel"] for r in subset], marker="x", color="r", label="README kernel")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(bottom=1e-4)
        ax.set_title(dataset)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m jax_flash_mla.accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small problem (batch 2, 1024 tokens, 16 heads)")
    parser.add_argument("--batch", type=positive_int, help="sequences (default 16; quick 2)")
    parser.add_argument("--seqlen", type=positive_int,
                        help="tokens per sequence, a multiple of 64 (default 4096; quick 1024)")
    parser.add_argument("--heads", type=positive_int, help="query heads (default 64; quick 16)")
    parser.add_argument("--datasets", default=",".join(DATASETS), type=list_flag(DATASETS, "--datasets"),
                        help=f"comma list of {','.join(DATASETS)} (default all)")
    parser.add_argument("--formats", default=",".join(KV_FORMATS), type=list_flag(KV_FORMATS, "--formats"),
                        help=f"comma list of {','.join(KV_FORMATS)} (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-sms", type=positive_int,
                        help="scheduler partitions (default: the device's SM count); as few as the batch makes each "
                             "sequence one split-KV chunk, the longest accumulation a kernel runs")
    parser.add_argument("--csv", help="CSV path (default accuracy.csv under $OUT, else the cwd)")
    parser.add_argument("--png", help="PNG path (default accuracy.png under $OUT, else the cwd)")
    args = parser.parse_args(argv)
    batch, seqlen = sized(args.batch, args.quick, 2, 16), sized(args.seqlen, args.quick, 1024, 4096)
    heads = sized(args.heads, args.quick, 16, 64)
    if seqlen % PAGE_SIZE:
        parser.error(f"--seqlen must be a positive multiple of {PAGE_SIZE}")
    rows = evaluate(args.datasets, args.formats, batch=batch, seqlen=seqlen, heads=heads, seed=args.seed,
                    num_sms=args.num_sms)
    csv_path, png_path = output_path(args.csv, "accuracy.csv"), output_path(args.png, "accuracy.png")
    write_csv(rows, csv_path, CSV_COLUMNS)
    plotted = plot(rows, png_path)
    print(f"\njax {jax.__version__} on {jax.devices()[0].device_kind}; kernels usable: "
          f"{sorted(kernel_formats()) or 'none'}; batch {batch}, {seqlen} tokens, {heads} heads, h_kv 1, s_q 1"
          + (f", {args.num_sms} scheduler SMs" if args.num_sms else ""))
    print(f"CSV {csv_path}" + (f"; PNG {png_path}" if plotted else ""))
    print(f"rel-L2 of out and max|dlse| vs float64 attention of the bf16 latent; floor = float64 attention on the "
          f"format's dequantized data; '!' = over {REGRESSION_FACTOR}x the largest README §4 figure"
          + ("" if (batch, seqlen, heads) == (16, 4096, 64) else " (README figures are for 16 x 4096 tokens, 64 "
             "heads)"))
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
