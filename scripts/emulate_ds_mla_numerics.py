"""Emulates candidate numerics of an fp8_ds_mla decode kernel (NumPy + ml_dtypes) and scores them against float64.

Usage: python3 scripts/emulate_ds_mla_numerics.py [--batch 16] [--seqlen 4096] [--heads 64] [--seed 0]
       [--token-scales]  (~40 s)

Data and truth follow jax_flash_mla/accuracy.py: bf16 q [b, h, 576] and bf16 latent tokens [b, t, 576] of each
README §4 data set; the truth is float64 attention over those UNQUANTIZED bf16 values (h_kv = 1, s_q = 1). The cache
is quantized by the package's own quantizer (quantize_kv_cache(..., "fp8_ds_mla")) and its 656-byte tokens decoded
here by hand. Every score is the rel-L2 of out and the max |Δlse| against the truth.

Roundings are placed where the kernel would place them; everything not named is float64 (exact for the sums of
e4m3 x e4m3 or bf16 x bf16 products that occur here):
* q NoPE -> e4m3 per (row, 128-channel group): scale = 2^ceil(log2(max(amax/448, 1e-4))) ("pow2") or the fp32
  amax/448 ("f32"); e4m3(f32(q / scale)) round-to-nearest-even. q RoPE stays bf16.
* FP8 WGMMA accumulation ("acc14"): each k-step of 32 products is summed exactly, rounded to 14 significant bits
  (13 stored fraction bits) toward zero, and added to the accumulator, whose result is again cut to 14 bits toward
  zero -- the e8m13 truncating accumulator reported for Hopper QGMMA, the reason DeepGEMM promotes every 128 of K.
  "exact" skips both cuts; "rn14" rounds to nearest instead of truncating (a model-sensitivity check).
* QK: RoPE part = bf16 WGMMA, rounded once to fp32. NoPE part: per 128-channel group g a fresh FP8 accumulator
  (4 k-steps), then promotion S = f32(S + f32(f32(q_scale[r,g] * k_scale[t,g]) * T_g)).
* softmax: running max per page of 64 tokens, p = f32(exp(scale*S - m_run)); row sum from the unrounded fp32 p.
* P (design A): per output group g, P_g[t] = e4m3(f32(p[t] * f[t,g])) with f[t,g] = k_scale[t,g] * 256 / n_g, n_g =
  max of k_scale[., g] over the page (a power of two, so f is exact): P_g <= 256 < 448 and p >= 2^-14 stays normal.
  PV per group and page: 2 FP8 k-steps into a fresh accumulator, promoted O_g = f32(O_g*o_scale + f32(T * n_g/256)).
  "A-PV-noprom": O stays in the WGMMA accumulator over all pages (128 k-steps at 4096 tokens), n_g is then the
  running max of k_scale over the pages seen so far and O_g is rescaled (fp32) when it or the row max moves.
  "A-noP-norm": f = k_scale (no normalizer), to show why one is needed. "A-QK-noprom*" (hypothetical: the format's
  per-token, per-group scales rule it out) runs all 16 NoPE k-steps through one 14-bit accumulator.
  "A-qrow": q quantized with one power-of-two scale per row (the largest of its four groups' amax / 448), so S
  factors as q_scale[r] * (RoPE' + sum_g k_scale[t,g] * T_g) and the promotion needs no per-group q factor.
  "A-exact-acc" is A without any accumulator cut; the column "vs A-exact" is |out - out(A-exact-acc)| / |truth|.
* S ("shift", on paper in session 38): the NoPE bytes re-expressed at each token's largest scale kmax[t]: with
  power-of-two scales, e4m3 * k_scale[t,g] / kmax[t] is an exponent shift by k = log2(kmax / k_scale) >= 0, exact
  while the result stays normal. "S-bits" models a shift by a saturating byte subtraction of k from the exponent
  field: a value whose exponent equals k keeps only its mantissa bits (a subnormal), a smaller one becomes 0.
  "S-rne" rounds those to nearest instead (e4m3 of the exact product). q per row (as A-qrow); QK = one FP8
  accumulator over the 16 NoPE k-steps, S = f32(RoPE + f32(q_scale[r] * kmax[t]) * T); P = e4m3(p * kmax[t] *
  256 / N) in one tile, N the running max of kmax over the pages (a power of two); PV = one FP8 accumulator over
  all pages, rescaled in fp32 when the row max or N moves (as A-PV-noprom), times N / 256 at the end.
* --token-scales: every variant and floor on a cache quantized at one scale per token (its four scales equal,
  the largest of the package's four), which the format decodes like any other; design S then shifts nothing.
* B: QK as A; V = e4m3 * k_scale exactly representable in bf16; P = bf16(p); bf16 PV accumulated in float64.
* C: q bf16, NoPE K dequantized to bf16 (exact); S rounded once to fp32; P bf16; bf16 PV (FlashMLA sparse-like).
* out = bf16(f32(O / l)) for the kernel variants; lse = f32(log l + m).
Floors (float64, no output rounding): F0 = q bf16 on the dequantized cache (the format's quantization-only floor);
Fq = q e4m3 per 128 (pow2) on the dequantized cache; F1 = Fq plus P = e4m3(p) unscaled (p = exp(s - row max) in
[0, 1]), the "q e4m3 per 128 ch, P e4m3" column of README §4.
The table goes to stdout (the only output); progress to stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
D_QK, D_V, GROUP, PAGE, KSTEP = 576, 512, 128, 64, 32
NG = D_V // GROUP
SOFTMAX_SCALE = D_QK ** -0.5
P_NORM = 256.0  # the normalized P_g maximum: a power of two below e4m3's 448
DATASETS = ("gaussian", "rope_outliers", "small_latent")


# ----------------------------------------------------------------------------------------------- rounding helpers
def f32(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def bf16(x):
    return np.asarray(x, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def e4m3(x):
    """float64 -> fp32 -> e4m3 (RNE, saturating as the kernel's SATFINITE cvt does) -> float64."""
    x = np.clip(np.asarray(x, np.float64).astype(np.float32), -448, 448)
    return x.astype(E4M3).astype(np.float64)


def cut(x, mode):
    """Accumulator rounding: 'exact' (none), 'acc14' (14 significant bits toward zero), 'rn14' (to nearest)."""
    if mode == "exact":
        return x
    m, e = np.frexp(x)  # m in [0.5, 1)
    m = m * 2.0 ** 14
    m = np.trunc(m) if mode == "acc14" else np.rint(m)
    return np.ldexp(m / 2.0 ** 14, e)


def pow2_ceil(x):
    m, e = np.frexp(x)
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


# ----------------------------------------------------------------------------------------------- data
def make_data(dataset, batch, seqlen, heads, seed, token_scales=False):
    """(q bf16-valued float64 [b,h,576], tokens float64 [b,t,576], ke [b,t,512], ks [b,t,4], rope [b,t,64]).

    token_scales: the NoPE bytes quantized again at one scale per token, the largest of its four (a cache the format
    still decodes: its four scales are then equal), e4m3(x / kmax) rounded to nearest as the package's quantizer does.
    """
    import jax.numpy as jnp

    from jax_flash_mla.accuracy import make_dataset
    from jax_flash_mla.quant import quantize_kv_cache

    rng = np.random.default_rng([seed, DATASETS.index(dataset)])
    q, tokens = make_dataset(rng, dataset, batch, seqlen, heads)
    raw = np.asarray(quantize_kv_cache(jnp.asarray(tokens), "fp8_ds_mla")).view(np.uint8)
    ke = raw[..., :512].view(E4M3).astype(np.float64)  # e4m3 values (unscaled)
    ks = np.ascontiguousarray(raw[..., 512:528]).view("<f4").astype(np.float64)  # [b, t, 4]
    rope = (np.ascontiguousarray(raw[..., 528:656]).view("<u2").astype(np.uint32) << 16).view(np.float32)
    if token_scales:
        ks = np.repeat(ks.max(axis=-1, keepdims=True), NG, axis=-1)
        ke = e4m3(np.asarray(tokens, np.float64)[..., :D_V] / np.repeat(ks, GROUP, axis=-1))
    return q.astype(np.float64), tokens.astype(np.float64), ke, ks, rope.astype(np.float64)


def attention_f64(q, keys, weights_fn=None):
    """Float64 attention of q [h, 576] over keys [t, 576]; weights_fn(p) may round p = exp(s - max) before P V."""
    logits = SOFTMAX_SCALE * (q @ keys.T)
    peak = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - peak)
    total = p.sum(axis=-1, keepdims=True)
    w = p if weights_fn is None else weights_fn(p)
    return (w @ keys[:, :D_V]) / total, (np.log(total) + peak)[:, 0]


# ----------------------------------------------------------------------------------------------- kernel pieces
def quantize_q(q_nope, mode):
    """q_nope [h, 512] -> (e4m3 values [h, 4, 128], scales [h, 4])."""
    g = q_nope.reshape(-1, NG, GROUP)
    amax = np.abs(g).max(axis=-1)
    if mode == "row-pow2":  # one power-of-two scale per row, shared by its four groups
        amax = np.repeat(amax.max(axis=-1, keepdims=True), NG, axis=-1)
    if mode in ("pow2", "row-pow2"):
        scale = pow2_ceil(np.maximum(amax / 448.0, 1e-4))
    else:
        scale = f32(np.where(amax > 0, f32(amax) / 448.0, 1.0))
    return e4m3(g / scale[..., None]), scale


def scores_fp8(q, ke, ks, rope, q_mode, acc, promote=True):
    """Raw q.k (fp32) of design A/B: bf16 RoPE WGMMA + per-group FP8 WGMMA with promotion.

    promote=False is hypothetical (the per-token, per-group scales make it impossible in a real kernel): the 16
    k-steps of the 512 NoPE channels, each already multiplied by its exact scales, share one 14-bit accumulator.
    """
    qe, qs = quantize_q(q[:, :D_V], q_mode)
    s = f32(q[:, D_V:] @ rope.T)  # bf16 x bf16 products exact; fp32 accumulation ~ one rounding
    t = ke.shape[0]
    if not promote:
        part = np.zeros((q.shape[0], t))
        for g in range(NG):
            sc = qs[:, g, None] * ks[None, :, g]
            kg = ke[:, g * GROUP:(g + 1) * GROUP]
            for j in range(GROUP // KSTEP):
                c = sc * (qe[:, g, j * KSTEP:(j + 1) * KSTEP] @ kg[:, j * KSTEP:(j + 1) * KSTEP].T)
                part = cut(part + cut(c, acc), acc)
        return f32(s + f32(part))
    for g in range(NG):
        kg = ke[:, g * GROUP:(g + 1) * GROUP]
        part = np.zeros((q.shape[0], t))
        for j in range(GROUP // KSTEP):
            c = qe[:, g, j * KSTEP:(j + 1) * KSTEP] @ kg[:, j * KSTEP:(j + 1) * KSTEP].T  # exact
            part = cut(part + cut(c, acc), acc)
        s = f32(s + f32(f32(qs[:, g, None] * ks[None, :, g]) * part))
    return s


def online_p(s):
    """p = f32(exp(scale*S - m_run)) with m_run the running row max by page; returns p, m_run [h, pages], m_final."""
    logits = SOFTMAX_SCALE * s
    h, t = logits.shape
    page_max = logits.reshape(h, t // PAGE, PAGE).max(axis=-1)
    m_run = np.maximum.accumulate(page_max, axis=1)
    p = f32(np.exp(logits - np.repeat(m_run, PAGE, axis=1)))
    return p, m_run


def row_sum(p, m_run):
    h, t = p.shape
    return (p.reshape(h, -1, PAGE).sum(-1) * np.exp(m_run - m_run[:, -1:])).sum(-1)


def finish(o, l, m_final):
    out = bf16(f32(o / l[:, None]))
    lse = f32(np.log(l) + m_final)
    return out, lse


def pv_fp8(p, m_run, ke, ks, acc, promote, normalize=True):
    """O (unnormalized, relative to the final max) of design A: P folded with k_scale per output group, e4m3."""
    h, t = p.shape
    pages = t // PAGE
    page_ks = ks.reshape(pages, PAGE, NG).max(axis=1)  # [pages, 4]
    norm = page_ks if promote else np.maximum.accumulate(page_ks, axis=0)  # n_g per page
    if not normalize:
        norm = np.full_like(norm, P_NORM)  # f = k_scale
    f = f32(ks * P_NORM / np.repeat(norm, PAGE, axis=0))  # [t, 4]
    steps = t // KSTEP
    # Exact k-step sums of P_g V_g: [steps, h, 512].
    chunks = np.empty((steps, h, D_V))
    for g in range(NG):
        pg = e4m3(p * f[None, :, g])  # [h, t]
        vg = ke[:, g * GROUP:(g + 1) * GROUP]
        chunks[:, :, g * GROUP:(g + 1) * GROUP] = np.matmul(
            pg.reshape(h, steps, KSTEP).transpose(1, 0, 2), vg.reshape(steps, KSTEP, GROUP))
    o_scale = f32(np.exp(-np.diff(m_run, axis=1, prepend=m_run[:, :1])))  # [h, pages], exp(m_prev - m_cur)
    per_page = PAGE // KSTEP
    ch_norm = np.repeat(norm, GROUP, axis=1) / P_NORM  # [pages, 512]
    o = np.zeros((h, D_V))
    if promote:
        for pg_i in range(pages):
            tmp = np.zeros((h, D_V))
            for j in range(per_page):
                tmp = cut(tmp + cut(chunks[pg_i * per_page + j], acc), acc)
            o = f32(f32(o * o_scale[:, pg_i, None]) + f32(tmp * ch_norm[pg_i]))
    else:
        prev = ch_norm[0]
        for pg_i in range(pages):
            # Rescale for a new row max and a new running normalizer (powers of two: exact), in fp32.
            o = f32(o * f32(o_scale[:, pg_i, None] * (prev / ch_norm[pg_i])))
            prev = ch_norm[pg_i]
            for j in range(per_page):
                o = cut(o + cut(chunks[pg_i * per_page + j], acc), acc)
        o = f32(o * ch_norm[-1])
    return o


def pv_bf16(p, m_run, v):
    """O of a bf16 PV WGMMA: P = bf16(p) relative to the running max, fp32 accumulation (~exact here)."""
    w = bf16(p) * np.repeat(np.exp(m_run - m_run[:, -1:]), PAGE, axis=1)
    return w @ v


def shift_cache(ke, ks, mode):
    """NoPE e4m3 values [t, 512] re-expressed at each token's largest scale: (values, kmax [t])."""
    kmax = ks.max(axis=1)
    ratio = np.repeat(ks / kmax[:, None], GROUP, axis=1)  # 2^-k per channel
    x = ke * ratio
    if mode == "rne":
        return e4m3(x), kmax
    ax = np.abs(x)
    top = ratio == 1.0
    # Exponent field e, shift k: e > k exact; e == k -> the mantissa bits as a subnormal (2 * (|x| - 2^-7)); e < k
    # (and every subnormal input with k > 0) -> 0.
    mantissa_only = np.sign(x) * 2.0 * (ax - 2.0 ** -7)
    shifted = np.where(ax >= 2.0 ** -6, x, np.where((ax >= 2.0 ** -7) & (np.abs(ke) >= 2.0 ** -6), mantissa_only, 0.0))
    return np.where(top, ke, shifted), kmax


def variant_shift(q, ke, ks, rope, mode):
    """(out, lse) of design S (docstring) on one sequence."""
    acc = "acc14"
    kv, kmax = shift_cache(ke, ks, mode)
    qe, qs = quantize_q(q[:, :D_V], "row-pow2")
    qe = qe.reshape(q.shape[0], D_V)
    rope_part = f32(q[:, D_V:] @ rope.T)
    t = ke.shape[0]
    part = np.zeros((q.shape[0], t))
    for j in range(D_V // KSTEP):
        part = cut(part + cut(qe[:, j * KSTEP:(j + 1) * KSTEP] @ kv[:, j * KSTEP:(j + 1) * KSTEP].T, acc), acc)
    s = f32(rope_part + f32(f32(qs[:, 0, None] * kmax[None, :]) * part))
    p, m_run = online_p(s)
    l = row_sum(p, m_run)
    h = p.shape[0]
    pages = t // PAGE
    n_run = np.maximum.accumulate(kmax.reshape(pages, PAGE).max(axis=1))  # [pages], powers of two
    f = f32(kmax * P_NORM / np.repeat(n_run, PAGE))
    pt = e4m3(p * f[None, :])
    o_scale = f32(np.exp(-np.diff(m_run, axis=1, prepend=m_run[:, :1])))
    o = np.zeros((h, D_V))
    prev = n_run[0]
    per_page = PAGE // KSTEP
    for pg_i in range(pages):
        o = f32(o * f32(o_scale[:, pg_i, None] * (prev / n_run[pg_i])))
        prev = n_run[pg_i]
        for j in range(per_page):
            c = pg_i * PAGE + j * KSTEP
            o = cut(o + cut(pt[:, c:c + KSTEP] @ kv[c:c + KSTEP, :D_V], acc), acc)
    o = f32(o * n_run[-1] / P_NORM)
    return finish(o, l, m_run[:, -1])


def variant(name, q, ke, ks, rope, kdeq):
    """(out, lse) of one kernel variant on one sequence."""
    if name in ("S-bits", "S-rne"):
        return variant_shift(q, ke, ks, rope, name[2:])
    if name == "C":
        s = f32(q @ kdeq.T)
        p, m_run = online_p(s)
        return finish(pv_bf16(p, m_run, kdeq[:, :D_V]), row_sum(p, m_run), m_run[:, -1])
    # q scale, accumulator model, QK promotion, PV promotion, P normalizer.
    spec = {"A": ("pow2", "acc14", True, True, True), "A-f32-qscale": ("f32", "acc14", True, True, True),
            "A-exact-acc": ("pow2", "exact", True, True, True), "A-rn14": ("pow2", "rn14", True, True, True),
            "A-PV-noprom": ("pow2", "acc14", True, False, True), "A-QK-noprom*": ("pow2", "acc14", False, True, True),
            "A-noP-norm": ("pow2", "acc14", True, True, False), "A-qrow": ("row-pow2", "acc14", True, True, True),
            "B": ("pow2", "acc14", True, None, None)}[name]
    q_mode, acc, qk_promote, promote, normalize = spec
    s = scores_fp8(q, ke, ks, rope, q_mode, acc, qk_promote)
    p, m_run = online_p(s)
    l = row_sum(p, m_run)
    if name == "B":
        o = pv_bf16(p, m_run, kdeq[:, :D_V])
    else:
        o = pv_fp8(p, m_run, ke, ks, acc, promote, normalize)
    return finish(o, l, m_run[:, -1])


VARIANTS = ("A-exact-acc", "A", "A-rn14", "A-PV-noprom", "A-QK-noprom*", "A-f32-qscale", "A-noP-norm", "A-qrow",
            "S-bits", "S-rne", "B", "C")
FLOORS = ("F0", "Fq", "F1")
# The floor of the precision each variant computes in (the accuracy target's denominator).
OWN_FLOOR = {"A": "F1", "A-f32-qscale": "F1", "A-exact-acc": "F1", "A-rn14": "F1", "A-PV-noprom": "F1",
             "A-noP-norm": "F1", "A-QK-noprom*": "F1", "A-qrow": "F1", "S-bits": "F1", "S-rne": "F1", "B": "Fq",
             "C": "F0", "F0": "F0", "Fq": "Fq", "F1": "F1"}


def floor(name, q, kdeq):
    if name == "F0":
        return attention_f64(q, kdeq)
    qe, qs = quantize_q(q[:, :D_V], "pow2")
    qd = np.concatenate([(qe * qs[..., None]).reshape(q.shape[0], D_V), q[:, D_V:]], axis=1)
    return attention_f64(qd, kdeq, None if name == "Fq" else e4m3)


def evaluate(batch, seqlen, heads, seed, token_scales=False):
    rows = []
    for dataset in DATASETS:
        t0 = time.time()
        q, tokens, ke, ks, rope = make_data(dataset, batch, seqlen, heads, seed, token_scales)
        # sum |Δ|², sum |ref|², max |Δlse|, sum |out - out(A-exact-acc)|²
        err = {n: [0.0, 0.0, 0.0, 0.0] for n in FLOORS + VARIANTS}
        for i in range(batch):
            kdeq = np.concatenate([(ke[i].reshape(-1, NG, GROUP) * ks[i][..., None]).reshape(-1, D_V), rope[i]], 1)
            true_out, true_lse = attention_f64(q[i], tokens[i])
            for n in FLOORS + VARIANTS:
                out, lse = floor(n, q[i], kdeq) if n in FLOORS else variant(n, q[i], ke[i], ks[i], rope[i], kdeq)
                e = err[n]
                e[0] += float(np.sum((out - true_out) ** 2))
                e[1] += float(np.sum(true_out ** 2))
                e[2] = max(e[2], float(np.max(np.abs(lse - true_lse))))
                if n == "A-exact-acc":
                    exact_out = out
                if n in VARIANTS:
                    e[3] += float(np.sum((out - exact_out) ** 2))
        rel = {n: math.sqrt(e[0] / e[1]) for n, e in err.items()}
        for n in FLOORS + VARIANTS:
            acc = math.sqrt(err[n][3] / err[n][1]) if n in VARIANTS else math.nan
            rows.append((dataset, n, rel[n], err[n][2], rel[n] / rel["F0"], OWN_FLOOR[n], rel[n] / rel[OWN_FLOOR[n]],
                         acc))
        print(f"[emulate] {dataset}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


def main(argv=None):
    global P_NORM
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--p-norm", type=float, default=P_NORM,
                    help="largest P_g after the per-group normalizer (default 256; smaller values leave headroom "
                         "for a lazy rescale that lets p exceed 1 by 256 / P_NORM)")
    ap.add_argument("--token-scales", action="store_true",
                    help="quantize the cache with one scale per token (the largest of its four groups'), which the "
                         "format decodes as four equal scales: what a writer would give design S without a shift")
    args = ap.parse_args(argv)
    assert args.seqlen % PAGE == 0
    P_NORM = args.p_norm
    t0 = time.time()
    rows = evaluate(args.batch, args.seqlen, args.heads, args.seed, args.token_scales)
    print(f"fp8_ds_mla decode numerics, emulated: batch {args.batch}, {args.seqlen} tokens, {args.heads} heads, "
          f"h_kv 1, s_q 1, seed {args.seed}, P_NORM {P_NORM:g}"
          f"{', one scale per token' if args.token_scales else ''}; truth = float64 attention on the bf16 latent")
    print("x floor: rel-L2 / rel-L2 of the floor of the precision the variant computes in; vs A-exact: "
          "|out - out(A-exact-acc)| / |truth| (the accumulator model's own share); * = hypothetical")
    print(f"{'data':<14}{'variant':<14}{'rel-L2':>9}{'max|dlse|':>11}{'x F0':>7}{'floor':>7}{'x floor':>9}"
          f"{'vs A-exact':>12}")
    for d, n, r, dl, x0, fl, xf, acc in rows:
        acc = "-" if math.isnan(acc) else f"{acc:.1e}"
        print(f"{d:<14}{n:<14}{r:>9.2e}{dl:>11.2e}{x0:>7.2f}{fl:>7}{xf:>9.2f}{acc:>12}")
    print(f"[emulate] total {time.time() - t0:.1f} s", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
