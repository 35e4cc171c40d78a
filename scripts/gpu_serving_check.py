"""Serving check on one GPU: examples/decode_step.py run as a serving loop, with the Hopper kernels.

For each cache format (those without a built kernel run the jnp reference, and the table says so):
  1. the compiled step calls the `jax_flash_mla_decode_<format>` custom call (kernel formats) and updates the donated
     cache in place (its parameter aliased to an output, no whole-cache copy / convert);
  2. the step runs inside XLA command buffers (CUDA graphs): XLA's `command-buffer-scheduling` pass moves commands
     into computations named `command_buffer*` and replaces them with a `call`; the decode custom call must be
     reachable from one (directly, or through a captured while loop). Read from the compiled HLO, from an HLO
     dump of that pass (--xla_dump_to) when the compiled text lacks it, or, where XLA forms command buffers as a
     thunk pass (jax 0.11.2), from the dumped thunk sequence: every custom-call thunk inside a kCommandBuffer;
  3. N decode steps (10 000 for kernel formats) with `memory_stats()` sampled along the way: bytes in use must not grow;
  4. at the end, the kernel's attention on the final cache matches the jnp reference of the same format.
A second child process times the bf16 step with command buffers disabled (`--xla_gpu_enable_command_buffer=`), as
runtime evidence that the graphs are used. XLA flags only take effect before JAX starts, hence the child processes.

    python scripts/gpu_serving_check.py            # H200: about 1-2 minutes
    python scripts/gpu_serving_check.py --steps 20 --formats bf16   # quick look (also runs on CPU, GPU checks n/a)

Exit status 1 when a check fails. Writes serving_check.json to $OUT when OUT is set.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FORMATS = ("bf16", "fp8_per_tensor", "fp8_ds_mla")
# Command types XLA may put in a CUDA graph (jax 0.11.2's XLA): fusions, cuBLAS(Lt), FFI custom calls whose handler
# has the kCmdBufferCompatible trait, cuDNN, and while / conditional (CUDA graph conditional nodes, CUDA >= 12.3)
# so the layer scan can be captured whole. min_graph_size=1: capture even short runs of commands.
GRAPH_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL "
               "--xla_gpu_graph_min_graph_size=1")
GRAPH_FLAGS_FALLBACK = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL "
                        "--xla_gpu_graph_min_graph_size=1")  # if this XLA rejects WHILE / CONDITIONAL
NO_GRAPH_FLAGS = "--xla_gpu_enable_command_buffer="
# rel-L2 of the kernel's attention output against the fp32 reference of the same format (README §4: bf16 ~2e-3,
# FP8 kernels quantize P (and q for fp8_ds_mla) to e4m3: a few 1e-2).
TOLERANCE = {"bf16": 1e-2, "fp8_per_tensor": 8e-2, "fp8_ds_mla": 8e-2}
MODEL = dict(layers=4, hidden=1024, heads=64, q_rank=512, nope_dim=128, v_dim=128, vocab=4096, batch=32,
             max_len=1024, tokens_per_step=1)
SMALL_MODEL = dict(layers=2, hidden=128, heads=8, q_rank=64, nope_dim=32, v_dim=32, vocab=256, batch=4, max_len=256,
                   tokens_per_step=1)  # off-GPU smoke runs


# ----------------------------------------------------------------------------------------------------------------
# HLO inspection

def _callees(lines) -> set:
    text = "\n".join(lines)
    names = set(re.findall(r"(?:to_apply|body|condition|calls)=%?([\w.\-]+)", text))
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        names.update(n.strip().lstrip("%") for n in group.split(","))
    return names


def in_command_buffer(text: str, needle: str):
    """(command buffer computations found, whether an instruction containing `needle` runs inside one)."""
    from jax_flash_mla import hlo

    comps = hlo.computations(text)
    roots = [name for name in comps if name.startswith("command_buffer")]
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        todo.extend(_callees(comps[name]))
    return len(roots), any(needle in line for name in seen for line in comps[name])


def thunk_custom_calls(text: str):
    """(command buffers, custom-call thunks inside one, custom-call thunks in all) of a thunk-sequence dump.

    Newer XLA (jax 0.11.2) forms command buffers as a thunk pass, not in HLO: its
    `*thunk_sequence_after_thunk_passes.txt` lists `kCommandBuffer` thunks with their commands indented below.
    """
    buffers = inside = total = 0
    open_indent = None  # indentation of the kCommandBuffer line whose block we are in
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if open_indent is not None and indent <= open_indent:
            open_indent = None
        if "kCommandBuffer" in line:
            buffers += 1
            open_indent = indent
        elif "kCustomCall" in line:
            total += 1
            inside += open_indent is not None
    return buffers, inside, total


# ----------------------------------------------------------------------------------------------------------------
# Child: runs the checks under the XLA flags it was started with

def load_example():
    spec = importlib.util.spec_from_file_location("decode_step", ROOT / "examples" / "decode_step.py")
    module = sys.modules["decode_step"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_l2(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_format(ds, kv_format, steps, dump_dir, timing_only):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import jax_flash_mla as fm
    from jax_flash_mla import hlo

    kernel = kv_format in fm.kernel_formats()
    model = MODEL if jax.devices()[0].platform == "gpu" else SMALL_MODEL
    cfg = ds.Config(**model, kv_format=kv_format, implementation="kernel" if kernel else "reference")
    row = {"format": kv_format, "path": "kernel" if kernel else "reference (no kernel built)", "steps": steps}
    step, params, (cache, table, seqlens, tokens) = ds.build(cfg, jax.devices()[:1])
    t0 = time.perf_counter()
    compiled = step.lower(params, cache, table, seqlens, tokens).compile()
    row["compile_s"] = round(time.perf_counter() - t0, 1)
    if not timing_only:
        text = compiled.as_text()
        target = f'custom_call_target="jax_flash_mla_decode_{kv_format}"'
        row["custom_call"] = target in text
        row["cache_aliased"] = hlo.params_aliased(text, cache.shape)
        row["full_cache_ops"] = sorted(hlo.ops_producing(text, cache.shape))
        found, captured = in_command_buffer(text, target if kernel else "custom-call")
        source = "compiled HLO"
        if not found and dump_dir:  # the pass's own dump, if the executable's text predates it
            for path in sorted(pathlib.Path(dump_dir).glob("*decode_step*command-buffer-scheduling*after*")):
                found, captured = in_command_buffer(path.read_text(), target if kernel else "custom-call")
                source = f"dump {path.name}"
        if not found and dump_dir:  # XLA that forms command buffers on thunks: the step's only custom calls are ours
            for path in sorted(pathlib.Path(dump_dir).glob("*decode_step*thunk_sequence_after_thunk_passes.txt")):
                found, inside, total = thunk_custom_calls(path.read_text())
                captured = kernel and total > 0 and inside == total
                source = f"thunks {path.name}: {inside}/{total} custom calls in command buffers"
        row.update(command_buffers=found, decode_in_command_buffer=captured, command_buffer_evidence=source)

    def stats():
        s = jax.devices()[0].memory_stats() or {}
        return s.get("bytes_in_use"), s.get("peak_bytes_in_use")

    for _ in range(2):  # warm up: first-call allocations
        cache, seqlens, tokens, logits = compiled(params, cache, table, seqlens, tokens)
    jax.block_until_ready(tokens)
    used0, _ = stats()
    samples = [used0]
    every = max(steps // 10, 1)
    t0 = time.perf_counter()
    for i in range(steps):
        cache, seqlens, tokens, logits = compiled(params, cache, table, seqlens, tokens)
        if (i + 1) % every == 0:
            jax.block_until_ready(tokens)
            samples.append(stats()[0])
    jax.block_until_ready(tokens)
    row["us_per_step"] = round((time.perf_counter() - t0) / steps * 1e6, 1)
    used1, peak = stats()
    row.update(bytes_in_use_start=used0, bytes_in_use_end=used1, peak_bytes_in_use=peak,
               bytes_in_use_samples=samples, mem_growth=(used1 - used0) if used0 is not None else None)
    if timing_only:
        return row

    # The kernel's attention on the final cache (layer 0 rows) against the jnp reference of the same format.
    key = jax.random.key(7)
    q = jax.random.normal(key, (cfg.batch, cfg.tokens_per_step, cfg.heads, 576), jnp.float32)
    q, scales = ds._format_q(q, kv_format)
    lengths = jnp.maximum(seqlens, 1)
    layer0 = table * cfg.layers
    out, lse = jax.jit(lambda q, c: fm.flash_mla_with_kvcache(
        q, c, layer0, lengths, 512, softmax_scale=cfg.softmax_scale, causal=True, kv_format=kv_format,
        implementation=cfg.implementation, **scales))(q, cache)
    ref_out, ref_lse = jax.jit(lambda q, c: fm.mla_decode_reference(
        q, c, layer0, lengths, softmax_scale=cfg.softmax_scale, causal=True, kv_format=kv_format, **scales))(q, cache)
    row["attn_rel_l2"] = rel_l2(out, ref_out)
    row["lse_max_abs"] = float(np.max(np.abs(np.asarray(lse) - np.asarray(ref_lse))))
    row["finite"] = bool(np.isfinite(np.asarray(logits)).all())
    return row


def child(args):
    import jax
    import jax_flash_mla as fm

    ds = load_example()
    info = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
            "kernel_formats": sorted(fm.kernel_formats()), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    rows = []
    for kv_format in args.formats:
        kernel = kv_format in fm.kernel_formats()
        steps = args.steps if kernel else min(args.steps, args.reference_steps)
        rows.append(check_format(ds, kv_format, steps, args.dump_dir, args.timing_only))
        print(json.dumps(rows[-1]), flush=True)
    pathlib.Path(args.result).write_text(json.dumps({"info": info, "rows": rows}))


# ----------------------------------------------------------------------------------------------------------------
# Parent: starts the children, judges, prints the table

def run_child(flags, formats, steps, reference_steps, timing_only, dump_dir=None, timeout=300):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    env = dict(os.environ)
    extra = f" --xla_dump_to={dump_dir} --xla_dump_hlo_pass_re=command-buffer-scheduling" if dump_dir else ""
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}{extra}".strip()
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    cmd = [sys.executable, __file__, "--child", "--result", result, "--steps", str(steps),
           "--reference-steps", str(reference_steps), "--formats", *formats]
    if timing_only:
        cmd.append("--timing-only")
    if dump_dir:
        cmd += ["--dump-dir", dump_dir]
    print(f"$ XLA_FLAGS='{env['XLA_FLAGS']}' {' '.join(cmd[1:])}", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"child timed out after {timeout} s", flush=True)
        return None
    if proc.returncode:
        return None
    return json.loads(pathlib.Path(result).read_text())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000, help="decode steps per kernel format")
    parser.add_argument("--reference-steps", type=int, default=1_000, help="steps for formats without a kernel")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--no-compare", action="store_true", help="skip the run without command buffers")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timing-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--dump-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    out_dir = pathlib.Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="serving_check_"))
    dump_dir = str(out_dir / "xla_dump_command_buffers")
    t_start = time.perf_counter()
    flags_used = GRAPH_FLAGS
    result = run_child(GRAPH_FLAGS, args.formats, args.steps, args.reference_steps, False, dump_dir)
    if result is None:
        print(f"child failed with {GRAPH_FLAGS!r}; retrying with {GRAPH_FLAGS_FALLBACK!r}", flush=True)
        flags_used = GRAPH_FLAGS_FALLBACK
        result = run_child(GRAPH_FLAGS_FALLBACK, args.formats, args.steps, args.reference_steps, False, dump_dir)
    if result is None:
        print("FAIL: the serving check crashed (see above)")
        return 1
    info, rows = result["info"], result["rows"]
    gpu = info["platform"] == "gpu"
    no_graphs = None
    if gpu and not args.no_compare and "bf16" in args.formats:
        steps = min(args.steps, 2_000)
        compare = run_child(NO_GRAPH_FLAGS, ["bf16"], steps, steps, True, timeout=150)
        no_graphs = compare["rows"][0]["us_per_step"] if compare else None

    failures = collections.defaultdict(list)
    for r in rows:
        kernel = r["path"] == "kernel"
        if kernel and not r["custom_call"]:
            failures[r["format"]].append("no decode custom call in the HLO")
        if not r["cache_aliased"] or "copy" in r["full_cache_ops"]:
            failures[r["format"]].append("cache not updated in place")
        if gpu and kernel and not r["decode_in_command_buffer"]:
            failures[r["format"]].append("decode not inside a command buffer")
        if r["mem_growth"] is not None and r["mem_growth"] > 0:
            failures[r["format"]].append(f"device memory grew by {r['mem_growth']} bytes")
        if r["attn_rel_l2"] > TOLERANCE[r["format"]] or not r["finite"]:
            failures[r["format"]].append(f"attention rel-L2 {r['attn_rel_l2']:.2e} vs the reference")

    mib = lambda b: "n/a" if b is None else f"{b / 2 ** 20:.1f}"
    print(f"\njax {info['jax']} on {info['device']}; kernels built: {info['kernel_formats'] or 'none'}")
    print(f"XLA_FLAGS: {flags_used}; command-buffer evidence: "
          + ", ".join(f"{r['format']}: {r.get('command_buffer_evidence')}" for r in rows))
    if no_graphs is not None:
        with_graphs = next(r["us_per_step"] for r in rows if r["format"] == "bf16")
        print(f"bf16 step: {with_graphs} us with command buffers, {no_graphs} us without")
    print("ops producing a whole-cache array (a 'convert' is a per-layer full-cache round trip of the scatter): "
          + "; ".join(f"{r['format']}: {','.join(r['full_cache_ops'])}" for r in rows))
    print(f"total {time.perf_counter() - t_start:.0f} s\n")
    header = (f"{'format':<15}{'path':<28}{'steps':>7}{'us/step':>9}{'custom call':>12}{'in place':>9}"
              f"{'cmd buffer':>11}{'MiB start':>10}{'MiB end':>9}{'MiB peak':>9}{'attn rel-L2':>12}  result")
    print(header)
    for r in rows:
        cb = "n/a" if not gpu else f"{r['command_buffers']}/{'yes' if r['decode_in_command_buffer'] else 'no'}"
        print(f"{r['format']:<15}{r['path']:<28}{r['steps']:>7}{r['us_per_step']:>9}"
              f"{'yes' if r['custom_call'] else 'no':>12}{'yes' if r['cache_aliased'] else 'no':>9}{cb:>11}"
              f"{mib(r['bytes_in_use_start']):>10}{mib(r['bytes_in_use_end']):>9}{mib(r['peak_bytes_in_use']):>9}"
              f"{r['attn_rel_l2']:>12.2e}  {'; '.join(failures[r['format']]) or 'ok'}")
    if os.environ.get("OUT"):
        (out_dir / "serving_check.json").write_text(json.dumps(
            {"info": info, "rows": rows, "us_per_step_without_command_buffers": no_graphs,
             "failures": dict(failures)}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
