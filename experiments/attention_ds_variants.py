"""Eighth round on flash attention against cuDNN (H200): dQ from a stored dS instead of recomputing it.
The recomputing backward runs seven tile matmuls per (key block, query block) pair: four in the dK/dV kernel
(S^T, dP^T, dV, dK) and three in the dQ kernel (S, dP again, then dQ). The dK/dV kernel already holds dS^T, rounded
to bf16, for its dK product; stored to memory (bf16, T x T per query head, in chunks of KV heads under a budget),
dQ = dS K is one matmul per pair, at the price of writing and reading dS once. Arms, per shape:
  recompute        the package's two-kernel backward (dQ kernel then dK/dV kernel)
  ds BMxBN/wW/sS   delta kernel, then per chunk dK/dV storing dS and dQ = dS K, with that dQ tile config
  ds, one chunk    the same with the budget lifted (dS for every head at once): what the chunking costs
Every arm is checked against float64 first (bf16, causal, odd lengths, GQA; the chunked path forced), then the
backward alone is timed in ROUNDS alternated rounds, with its peak memory; last, forward + backward against cuDNN
for the recomputing backward and the fastest 'ds' config of each shape.
The kernels live here, not in the package: the measured run (commit f5a75b8, where they were the package's) found them
slower than the recomputing backward at every shape, so they did not stay.
`python experiments/attention_ds_variants.py` on a GPU (writes data/results/attention_ds_variants.json, a copy in $OUT; the recorded run is kept in
experiments/results/attention_ds_variants.json)."""
import math, os, shutil, time
import torch
import triton
import triton.language as tl
from rtrainer.attention import (fused_qkv_views, flash_attention_forward, flash_attention_backward, flash_attention,
                                attention_flops, attention_reference, tuned_config, config_kwargs, _sdpa_attention, LOG2_E,
                                _query_block, _unit_stride, _precision, REFERENCE_ATTENTION_SHAPES, SWEEP_TOKENS, SWEEP_HEADS)
from rtrainer.kernels import median_ms, ratio_interval, relative_error, save_results

ROUNDS = 3
REP_MS = 60
SHAPES = tuple(os.environ.get("DS_SHAPES", "rb100m,prof183m,dense1b,moe4b,T2048,T4096,T8192").split(","))
DQ_DS_CONFIGS = [(64, 64, 4, 3, None), (128, 64, 8, 3, None), (64, 32, 4, 3, None), (128, 128, 8, 3, None), (128, 64, 4, 3, None)]
CHECKS = [(2, 1000, 12, 4, 64, True), (1, 777, 16, 16, 128, True), (2, 513, 8, 1, 64, True), (1, 300, 4, 2, 128, False),
          (1, 4099, 4, 2, 64, True)]
DS_BUDGET_BYTES = 256 * 2**20   # the most the stored dS takes at once: the backward runs in chunks of KV heads under it
DS_PAD = 128                    # dS is stored as (T', T') per query head, T' = T rounded up to this (every block divides it)
FAILED = {}                     # (head dim, config) -> why it did not compile or run

# ------------------------------------------------------- kernels: the package's dK/dV kernel storing dS, delta, dQ = dS K
@triton.jit
def _ds_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot, stride_dsk,
                k_pos, lo, hi, T, scale_log2, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
                PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        q_pos = start_m + tl.arange(0, BLOCK_M)
        rows = q_pos < T
        q = tl.load(q_base + q_pos[:, None] * stride_qt + offs_d[None, :], mask=rows[:, None], other=0.0)
        do = tl.load(do_base + q_pos[:, None] * stride_dot + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(lse_base + q_pos, mask=rows, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + q_pos, mask=rows, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2   # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(sT - lse2[None, :])
        if MASKED:
            pT = tl.where(q_pos[None, :] >= k_pos[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)                       # (BLOCK_N, hd)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)                 # (BLOCK_N, BLOCK_M)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)                 # rounded as the dQ kernel rounds it
        tl.store(ds_base + k_pos[:, None] * stride_dsk + q_pos[None, :], dsT)    # dS^T tile, for dQ = dS K afterwards
        dk += tl.dot(dsT, q, input_precision=PRECISION)
    return dk, dv

@triton.jit
def ds_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,                    # dk/dv (B,T,KV,hd) contiguous, summed over the group's query heads
    DS,                                                 # dS^T per query head of this launch's KV heads, (keys, queries)
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh, stride_dsh, stride_dsk,
    H, KV, T, GROUP, scale_log2, sm_scale, FIRST_BKV,   # FIRST_BKV: this launch's first b * KV + kv head
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1) + FIRST_BKV
    b, kvh = (bkv // KV).to(tl.int64), (bkv % KV).to(tl.int64)
    k_pos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = k_pos[:, None] < T
    k = tl.load(K + b * stride_kb + kvh * stride_kh + k_pos[:, None] * stride_kt + offs_d[None, :], mask=keys, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + k_pos[:, None] * stride_vt + offs_d[None, :], mask=keys, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if CAUSAL:
        diag_end = tl.minimum(start_n + BLOCK_N, T)
    else:
        diag_end = 0
    for g in range(0, GROUP):                           # every query head that reads this KV head
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h) * T
        delta_base = DELTA + (b * H + h) * T
        ds_base = DS + (tl.program_id(1) * GROUP + g).to(tl.int64) * stride_dsh
        if CAUSAL:
            dk, dv = _ds_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot,
                                 stride_dsk, k_pos, start_n, diag_end, T, scale_log2, BLOCK_M, HEAD_DIM, True, PRECISION)
            dk, dv = _ds_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot,
                                 stride_dsk, k_pos, start_n + BLOCK_N, T, T, scale_log2, BLOCK_M, HEAD_DIM, False, PRECISION)
        else:
            dk, dv = _ds_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, ds_base, stride_qt, stride_dot,
                                 stride_dsk, k_pos, 0, T, T, scale_log2, BLOCK_M, HEAD_DIM, False, PRECISION)
    out = b * stride_dkb + kvh * stride_dkh + k_pos[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=k_pos[:, None] < T)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=k_pos[:, None] < T)

@triton.jit
def delta_kernel(
    O, DO, DELTA, stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, H, T,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    "delta = rowsum(dO * O), (B,H,T) fp32: what the dK/dV kernel needs before it can store dS."
    start_m, b, h, kvh, q_pos, offs_d = _query_block(H, 1, BLOCK_M, HEAD_DIM)
    rows = q_pos[:, None] < T
    o = tl.load(O + b * stride_ob + h * stride_oh + q_pos[:, None] * stride_ot + offs_d[None, :], mask=rows, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + q_pos[:, None] * stride_dot + offs_d[None, :], mask=rows, other=0.0)
    tl.store(DELTA + (b * H + h) * T + q_pos, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=q_pos < T)

@triton.jit
def dq_from_ds_kernel(
    DS, K, DQ,                                          # DS: the dK/dV kernel's dS^T tiles, (keys, queries) per query head
    stride_dsh, stride_dsk, stride_kb, stride_kt, stride_kh, stride_dqb, stride_dqt, stride_dqh,
    H, T, GROUP, sm_scale, FIRST_BH,                    # FIRST_BH: this launch's first b * H + h
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr):
    "dQ = dS K: one matmul per tile pair, where the recomputing dQ kernel does three."
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1) + FIRST_BH
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    k_base = K + b * stride_kb + (h // GROUP) * stride_kh
    ds_base = DS + tl.program_id(1).to(tl.int64) * stride_dsh
    q_pos = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        full_end, end = start_m, tl.minimum(start_m + BLOCK_M, T)
    else:
        full_end, end = (T // BLOCK_N) * BLOCK_N, T
    for start_n in range(0, full_end, BLOCK_N):         # whole tiles: every entry written by the dK/dV kernel
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + k_pos[:, None] * stride_kt + offs_d[None, :])
        dsT = tl.load(ds_base + k_pos[:, None] * stride_dsk + q_pos[None, :])
        dq = tl.dot(tl.trans(dsT), k, dq, input_precision=PRECISION)
    for start_n in range(full_end, end, BLOCK_N):      # the diagonal and the last keys: read only what was written
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + k_pos[:, None] * stride_kt + offs_d[None, :], mask=k_pos[:, None] < T, other=0.0)
        keep = k_pos[:, None] < T
        if CAUSAL: keep = keep & (k_pos[:, None] <= q_pos[None, :])
        dsT = tl.load(ds_base + k_pos[:, None] * stride_dsk + q_pos[None, :], mask=keep, other=0.0)
        dq = tl.dot(tl.trans(dsT), k, dq, input_precision=PRECISION)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + q_pos[:, None] * stride_dqt + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_pos[:, None] < T)

# ---------------------------------------------------------------------------------------------------------- launchers
def ds_backward(do, q, k, v, o, lse, causal=True, dq=None, dk=None, dv=None, ds_budget=DS_BUDGET_BYTES, dq_config=DQ_DS_CONFIGS[0]):
    "delta, then per chunk of KV heads (dS under `ds_budget` bytes) dK/dV storing dS^T and dQ = dS K; (dq, dk, dv)."
    do, q, k, v, o = (_unit_stride(t) for t in (do, q, k, v, o))
    B, T, H, hd = q.shape
    KV = k.shape[2]
    group, sm_scale, precision = H // KV, 1.0 / math.sqrt(hd), _precision(q.dtype)
    dq = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device) if dq is None else dq
    dk = torch.empty(B, T, KV, hd, dtype=q.dtype, device=q.device) if dk is None else dk
    dv = torch.empty(B, T, KV, hd, dtype=q.dtype, device=q.device) if dv is None else dv
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    delta_kernel[(triton.cdiv(T, 64), B * H)](o, do, delta, *o.stride()[:3], *do.stride()[:3], H, T, HEAD_DIM=hd, BLOCK_M=64, num_warps=4)
    t_pad = triton.cdiv(T, DS_PAD) * DS_PAD
    chunk = max(1, min(B * KV, ds_budget // (group * t_pad * t_pad * q.element_size())))
    ds = torch.empty(chunk * group, t_pad, t_pad, dtype=q.dtype, device=q.device)
    kv_config, dq_kw = tuned_config("dkdv", hd, T), config_kwargs(dq_config)
    for first in range(0, B * KV, chunk):
        n = min(chunk, B * KV - first)
        ds_dkdv_kernel[(triton.cdiv(T, kv_config["BLOCK_N"]), n)](
            q, k, v, do, lse, delta, dk, dv, ds, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
            *dk.stride()[:3], *ds.stride()[:2], H, KV, T, group, sm_scale * LOG2_E, sm_scale, first,
            HEAD_DIM=hd, CAUSAL=causal, PRECISION=precision, **kv_config)
        dq_from_ds_kernel[(triton.cdiv(T, dq_kw["BLOCK_M"]), n * group)](
            ds, k, dq, *ds.stride()[:2], *k.stride()[:3], *dq.stride()[:3], H, T, group, sm_scale, first * group,
            HEAD_DIM=hd, CAUSAL=causal, PRECISION=precision, **dq_kw)
    return dq, dk, dv

class DsAttention(torch.autograd.Function):
    "The package's forward, this backward (the config of dQ = dS K in `DsAttention.dq_config`)."
    dq_config = DQ_DS_CONFIGS[0]
    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = flash_attention_forward(q, k, v, True)
        ctx.save_for_backward(q, k, v, o, lse)
        return o
    @staticmethod
    def backward(ctx, do):
        return ds_backward(do, *ctx.saved_tensors, True, dq_config=DsAttention.dq_config)

def dims(shape):
    if shape in REFERENCE_ATTENTION_SHAPES: return REFERENCE_ATTENTION_SHAPES[shape]
    T = int(shape[1:]); H, KV, hd = SWEEP_HEADS
    return max(1, SWEEP_TOKENS // T), H, KV, T, hd

def arm_name(c): return f"ds {c[0]}x{c[1]}/w{c[2]}/s{c[3]}"

def checks():
    rows = []
    for B, T, H, KV, hd, causal in CHECKS:
        q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
        do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
        o, lse = flash_attention_forward(q, k, v, causal)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(attention_reference(q64, k64, v64, causal), (q64, k64, v64), do.double())
        base = flash_attention_backward(do, q, k, v, o, lse, causal)
        for c in DQ_DS_CONFIGS:
            for budget in (DS_BUDGET_BYTES, 1):          # 1 byte: one KV head per chunk
                if (hd, c) in FAILED: continue
                nan = lambda *s: torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda")
                try:
                    got = ds_backward(do, q, k, v, o, lse, causal, dq=nan(B, T, H, hd), dk=nan(B, T, KV, hd),
                                      dv=nan(B, T, KV, hd), ds_budget=budget, dq_config=c)
                except Exception as e:                   # out of shared memory, say: listed, not timed
                    FAILED[(hd, c)] = f"{type(e).__name__}: {str(e)[:160]}"
                    print("did not run:", hd, c, FAILED[(hd, c)], flush=True)
                    continue
                errs = {n: relative_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
                ok = all(g.isfinite().all() for g in got) and max(errs.values()) < 1e-2
                rows.append(dict(B=B, T=T, H=H, KV=KV, hd=hd, causal=causal, config=c, budget=budget, ok=ok,
                                 dkdv_equal_to_recompute=torch.equal(got[1], base[1]) and torch.equal(got[2], base[2]), **errs))
                if not ok: print("FAILED", rows[-1], flush=True)
        mine = [r for r in rows if (r["B"], r["T"], r["H"], r["hd"]) == (B, T, H, hd)]
        print(f"check B{B} T{T} H{H}/{KV} hd{hd} causal={causal}: recompute dq {relative_error(base[0], ref[0]):.1e}, "
              f"ds worst {max(max(r['dq'], r['dk'], r['dv']) for r in mine):.1e}, dK/dV equal to recompute's: "
              f"{all(r['dkdv_equal_to_recompute'] for r in mine)}", flush=True)
    return rows

def time_shape(shape):
    "The backward alone: recompute against each dQ config and the chunking, alternated rounds, with each arm's peak memory."
    B, H, KV, T, hd = dims(shape)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_attention_forward(q, k, v)
    arms = {"recompute": lambda: flash_attention_backward(do, q, k, v, o, lse, True)}
    for c in DQ_DS_CONFIGS:
        if (hd, c) not in FAILED: arms[arm_name(c)] = lambda c=c: ds_backward(do, q, k, v, o, lse, True, dq_config=c)
    arms["ds, one chunk"] = lambda: ds_backward(do, q, k, v, o, lse, True, ds_budget=1 << 40)
    if T >= 4096: arms["ds, 2 GiB chunks"] = lambda: ds_backward(do, q, k, v, o, lse, True, ds_budget=2 << 30)
    flops = 2.5 * attention_flops(B, H, T, hd)
    times, peaks = {a: [] for a in arms}, {}
    for r in range(ROUNDS):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            if r == 0:
                arms[a](); torch.cuda.synchronize()
                base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
                arms[a](); torch.cuda.synchronize()
                peaks[a] = (torch.cuda.max_memory_allocated() - base) / 2**20
            times[a].append(median_ms(arms[a], rep_ms=REP_MS))
    rows = []
    for a in arms:
        ms = sorted(times[a])[ROUNDS // 2]
        ratio, low, high = ratio_interval([b / t for b, t in zip(times["recompute"], times[a])])
        rows.append(dict(shape=shape, B=B, H=H, KV=KV, T=T, hd=hd, arm=a, bwd_ms=ms, bwd_tflops=flops / ms / 1e9,
                         speedup_vs_recompute=ratio, ci95=(low, high), peak_mib=peaks[a], rounds_ms=times[a]))
        print(f"{shape:9} {a:24} bwd {ms:.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  x{ratio:.3f} [{low:.3f}, {high:.3f}]  "
              f"peak +{peaks[a]:.0f} MiB", flush=True)
    return rows

def versus_cudnn(shape, best_config):
    "Forward + backward: the package (recompute), the best 'ds' config, cuDNN; alternated rounds."
    B, H, KV, T, hd = dims(shape)
    q, k, v = (t.requires_grad_() for t in fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda"))
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    DsAttention.dq_config = best_config
    fns = {"recompute": flash_attention, "ds": DsAttention.apply, "cudnn": _sdpa_attention("CUDNN_ATTENTION", H != KV)}
    arms = {a: (lambda f=f: torch.autograd.grad(f(q, k, v), (q, k, v), do)) for a, f in fns.items()}
    times = {a: [] for a in arms}
    for r in range(ROUNDS):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[a].append(median_ms(arms[a], rep_ms=REP_MS))
    flops = 3.5 * attention_flops(B, H, T, hd)
    rows = []
    for a in arms:
        ms = sorted(times[a])[ROUNDS // 2]
        ratio, low, high = ratio_interval([c / t for c, t in zip(times["cudnn"], times[a])])
        rows.append(dict(shape=shape, arm=a, config=best_config if a == "ds" else None, fwd_bwd_ms=ms,
                         fwd_bwd_tflops=flops / ms / 1e9, speed_vs_cudnn=ratio, ci95=(low, high), rounds_ms=times[a]))
        print(f"{shape:9} fwd+bwd {a:10} {ms:.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  vs cuDNN x{ratio:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    return rows

if __name__ == "__main__":
    t0 = time.time()
    check_rows = checks()
    assert all(r["ok"] for r in check_rows), "a 'ds' arm failed its float64 check"
    bwd_rows, versus_rows = [], []
    for shape in SHAPES:
        rows = time_shape(shape)
        bwd_rows += rows
        best = min((r for r in rows if r["arm"] in {arm_name(c) for c in DQ_DS_CONFIGS}), key=lambda r: r["bwd_ms"])
        versus_rows += versus_cudnn(shape, next(c for c in DQ_DS_CONFIGS if arm_name(c) == best["arm"]))
        print(f"--- {shape} done at {time.time() - t0:.0f} s", flush=True)
    path = save_results("attention_ds_variants", dict(checks=check_rows, backward=bwd_rows, versus_cudnn=versus_rows),
                        rounds=ROUNDS, dq_ds_configs=DQ_DS_CONFIGS, ds_budget_bytes=DS_BUDGET_BYTES,
                        did_not_run={f"hd{k[0]} {k[1]}": v for k, v in FAILED.items()})
    if os.environ.get("OUT"): shutil.copy(path, os.environ["OUT"])
    print("\n=== forward + backward against cuDNN (TFLOP/s, speed ratio [95%])")
    for shape in SHAPES:
        r = {x["arm"]: x for x in versus_rows if x["shape"] == shape}
        print(f"{shape:9} recompute {r['recompute']['fwd_bwd_tflops']:6.1f} x{r['recompute']['speed_vs_cudnn']:.3f}   "
              f"ds {r['ds']['fwd_bwd_tflops']:6.1f} x{r['ds']['speed_vs_cudnn']:.3f} [{r['ds']['ci95'][0]:.3f}, {r['ds']['ci95'][1]:.3f}] "
              f"{r['ds']['config']}   cuDNN {r['cudnn']['fwd_bwd_tflops']:6.1f}")
