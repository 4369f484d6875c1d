"""Fourth round on flash attention against cuDNN (H200): fewer instructions per score instead of new memory paths.
The forward at head dim 64 issues, per score element, about as many exp2 (16 per clock per SM) and FP32 ALU
instructions as its two matmuls take on the tensor cores, so every instruction saved per element counts.
  fwd baseline   rtrainer's autotuned flash_attention_forward. Since commit 119919f it is the "fold" variant of
                 the recorded run (commit c3ac51a): the row maximum taken on the raw scores (scale > 0 commutes
                 with max), so the exponent's argument is one fused multiply-add instead of a multiply then a
                 subtract. The recorded run timed the forward as it was before, as its own arm.
  fwd lazy       fold, and the running maximum moves only when some row's maximum grew by more than 2^8 (in
                 log2 units, TAU = 8): the accumulator's rescale (HEAD_DIM/BLOCK_N multiplies per score) is
                 skipped on most blocks; probabilities then reach at most 2^8, harmless in fp32 sums and bf16
  bwd baseline   rtrainer's flash_attention_backward: dK/dV kernel over key blocks, dQ kernel over query blocks
                 (7 matmuls per tile pair: the dQ kernel recomputes the scores and dP)
  bwd atomic     one kernel over key blocks computes dK, dV and adds each tile's dQ into an fp32 buffer with
                 atomic adds (5 matmuls per tile pair), then a cast makes dQ bf16. Summation order of dQ then
                 varies from run to run. (The recorded run computed delta = rowsum(dO * O) and zeroed the buffer
                 in one preprocess kernel; this script computes delta with torch and zeroes with torch.zeros.)
Each variant is checked against a float64 reference (bf16, causal, GQA, T off every tile), then timed against
SDPA's cuDNN backend at the four reference shapes, arms alternating over 3 rounds; last, the best forward plus the
best backward is timed as one step against cuDNN's forward + backward.
`python experiments/attention_math_variants.py` on a GPU (writes $OUT/attention_math_variants.json when OUT is set);
`TRITON_INTERPRET=1 python experiments/attention_math_variants.py --cpu-check` checks the kernels' math in fp32 on a CPU."""
import json, math, os, statistics, sys, time
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_variants import reference, one_line                    # float64 reference (o, lse), error lines
from rtrainer.attention import (flash_attention_forward, flash_attention_backward, attention_flops, LOG2_E,
                                _query_block, TUNED_CONFIGS, REFERENCE_ATTENTION_SHAPES, tuned_config)
from rtrainer.kernels import median_ms, relative_error, INTERPRETING

TIME_GUARD_S = 420
ROUNDS = 3
TAU = 8.0                                                # lazy rescale threshold, log2 units (a factor of 256)
CHECK_SHAPES = {64: (2, 1000, 12, 4), 128: (1, 777, 16, 16)}   # head dim: (B, T, H, KV)
T_START = time.time()

# ------------------------------------------------------------------------------------------------------- forward
@triton.jit
def _lazy_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, lo, hi, T, scale_log2,
                BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, TAU: tl.constexpr,
                PRECISION: tl.constexpr):
    "rtrainer's _forward_inner, with the rescale skipped unless some row's maximum grew by more than 2^TAU."
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        kT_ptrs = k_base + k_pos[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = v_base + k_pos[:, None] * stride_vt + offs_d[None, :]
        if MASKED:
            kT = tl.load(kT_ptrs, mask=k_pos[None, :] < T, other=0.0)
            v = tl.load(v_ptrs, mask=k_pos[:, None] < T, other=0.0)
        else:
            kT, v = tl.load(kT_ptrs), tl.load(v_ptrs)
        s = tl.dot(q, kT, input_precision=PRECISION)                       # raw scores
        if MASKED:
            s = tl.where((k_pos[None, :] < T) & (q_pos[:, None] >= k_pos[None, :]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        if tl.max(m_new - m_i, 0) > TAU:                                   # one branch for the whole block
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.math.exp2(s * scale_log2 - m_i[:, None])                   # one FMA per score
        l_i += tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_i, l_i

@triton.jit
def lazy_forward_kernel(                                # rtrainer's flash_forward_kernel (causal) over _lazy_inner
    Q, K, V, O, LSE, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, H, T, GROUP, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAU: tl.constexpr, PRECISION: tl.constexpr):
    start_m, b, h, kvh, q_pos, offs_d = _query_block(H, GROUP, BLOCK_M, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_pos[:, None] * stride_qt + offs_d[None, :],
                mask=q_pos[:, None] < T, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    acc, m_i, l_i = _lazy_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, 0, start_m, T,
                                scale_log2, BLOCK_N, HEAD_DIM, False, TAU, PRECISION)
    acc, m_i, l_i = _lazy_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, start_m,
                                tl.minimum(start_m + BLOCK_M, T), T, scale_log2, BLOCK_N, HEAD_DIM, True, TAU, PRECISION)
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + q_pos[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=q_pos[:, None] < T)
    tl.store(LSE + (b * H + h) * T + q_pos, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

_lazy_tuned = lazy_forward_kernel if INTERPRETING else triton.autotune(   # the configs rtrainer's forward runs, any head dim or length
    [triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2], num_stages=c[3], maxnreg=c[4])
     for c in sorted(set(TUNED_CONFIGS["forward"].values()), key=str)], key=["HEAD_DIM"])(lazy_forward_kernel)

def lazy_forward(q, k, v, o=None, lse=None, *, config=None):
    "Causal forward with the lazy rescale; returns (o, lse) like flash_attention_forward."
    B, T, H, hd = q.shape
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32) if lse is None else lse
    launch = lazy_forward_kernel if config else _lazy_tuned
    launch[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, T, H // k.shape[2],
        LOG2_E / math.sqrt(hd), HEAD_DIM=hd, TAU=TAU, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **(config or {}))
    return o, lse

# ------------------------------------------------------------------------------------------------------ backward
@triton.jit
def _atomic_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, stride_qt, stride_dot, stride_dqt,
                  k_pos, lo, hi, T, scale_log2, sm_scale, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASKED: tl.constexpr, DQ_TMA: tl.constexpr, PRECISION: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M):
        q_pos = start_m + tl.arange(0, BLOCK_M)
        rows = q_pos < T
        q = tl.load(q_base + q_pos[:, None] * stride_qt + offs_d[None, :], mask=rows[:, None], other=0.0)
        do = tl.load(do_base + q_pos[:, None] * stride_dot + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(lse_base + q_pos, mask=rows, other=0.0) * 1.4426950408889634
        delta = tl.load(delta_base + q_pos, mask=rows, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PRECISION)               # (BLOCK_N, BLOCK_M) raw scores
        pT = tl.math.exp2(sT * scale_log2 - lse2[None, :])
        if MASKED:
            pT = tl.where(q_pos[None, :] >= k_pos[:, None], pT, 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q, input_precision=PRECISION)
        dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION) * sm_scale  # (BLOCK_M, hd) this key block's share
        if DQ_TMA:                                      # one bulk reduce-add of the tile through the TMA unit
            dq_base.atomic_add([start_m, 0], dq)
        else:                                           # one atomic add per element
            tl.atomic_add(dq_base + q_pos[:, None] * stride_dqt + offs_d[None, :], dq, mask=rows[:, None], sem="relaxed")
    return dk, dv

@triton.jit
def atomic_backward_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_dkb, stride_dkt, stride_dkh,
    H, KV, T, GROUP, scale_log2, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_TMA: tl.constexpr, PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b, kvh = (bkv // KV).to(tl.int64), (bkv % KV).to(tl.int64)
    k_pos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    keys = k_pos[:, None] < T
    k = tl.load(K + b * stride_kb + kvh * stride_kh + k_pos[:, None] * stride_kt + offs_d[None, :], mask=keys, other=0.0)
    v = tl.load(V + b * stride_vb + kvh * stride_vh + k_pos[:, None] * stride_vt + offs_d[None, :], mask=keys, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diag_end = tl.minimum(start_n + BLOCK_N, T)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        dq_base = DQ_ACC + (b * T * H + h) * HEAD_DIM                          # (B,T,H,hd) contiguous fp32
        if DQ_TMA:                                                            # this head's [T, hd] rows, bounded at T
            dq_base = tl.make_tensor_descriptor(dq_base, [T, HEAD_DIM], [H * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
        lse_base = LSE + (b * H + h) * T
        delta_base = DELTA + (b * H + h) * T
        dk, dv = _atomic_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, stride_qt, stride_dot,
                               H * HEAD_DIM, k_pos, start_n, diag_end, T, scale_log2, sm_scale, BLOCK_M, HEAD_DIM, True, DQ_TMA, PRECISION)
        dk, dv = _atomic_inner(dk, dv, k, v, q_base, do_base, dq_base, lse_base, delta_base, stride_qt, stride_dot,
                               H * HEAD_DIM, k_pos, start_n + BLOCK_N, T, T, scale_log2, sm_scale, BLOCK_M, HEAD_DIM, False, DQ_TMA, PRECISION)
    out = b * stride_dkb + kvh * stride_dkh + k_pos[:, None] * stride_dkt + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=k_pos[:, None] < T)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=k_pos[:, None] < T)

ATOMIC_CONFIGS = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
                  for m, n, w, s in ((32, 64, 4, 3), (64, 64, 8, 3), (32, 128, 8, 3), (64, 128, 8, 3))]   # the ones ptxas fits best
_atomic_tuned = atomic_backward_kernel if INTERPRETING else triton.autotune(
    ATOMIC_CONFIGS, key=["HEAD_DIM", "DQ_TMA"], restore_value=["DQ_ACC"])(atomic_backward_kernel)   # tuning must not add twice

def atomic_backward(do, q, k, v, o, lse, dq=None, dk=None, dv=None, *, tma=False, config=None):
    "Causal backward with dQ by atomic adds; returns (dq, dk, dv) like flash_attention_backward."
    B, T, H, hd = q.shape
    KV = k.shape[2]
    sm_scale = 1.0 / math.sqrt(hd)
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()     # (B, H, T) fp32, rowsum(dO * O)
    dq_acc = torch.zeros(B, T, H, hd, device=q.device, dtype=torch.float32)
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    launch = atomic_backward_kernel if config else _atomic_tuned
    launch[lambda meta: (triton.cdiv(T, meta["BLOCK_N"]), B * KV)](
        q, k, v, do, lse, delta, dk, dv, dq_acc, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        *dk.stride()[:3], H, KV, T, H // KV, sm_scale * LOG2_E, sm_scale, HEAD_DIM=hd, DQ_TMA=tma,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **(config or {}))
    if dq is None: return dq_acc.to(q.dtype), dk, dv
    dq.copy_(dq_acc)
    return dq, dk, dv

FORWARDS = {"fwd baseline": lambda q, k, v, o=None, lse=None: flash_attention_forward(q, k, v, True, o, lse),
            "fwd lazy": lambda q, k, v, o=None, lse=None: lazy_forward(q, k, v, o, lse)}
BACKWARDS = {"bwd baseline": lambda do, q, k, v, o, lse: flash_attention_backward(do, q, k, v, o, lse, True),
             "bwd atomic": lambda do, q, k, v, o, lse: atomic_backward(do, q, k, v, o, lse),
             "bwd atomic tma": lambda do, q, k, v, o, lse: atomic_backward(do, q, k, v, o, lse, tma=True)}

# ---------------------------------------------------------------------------------------------------------- checks
def reference_grads(q, k, v, do):
    "(o, lse, dq, dk, dv) in float64."
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, lse = reference(q64, k64, v64)
    return (o.detach(), lse.detach(), *torch.autograd.grad(o, (q64, k64, v64), do.double()))

def errors(q, k, v, do, fwd, bwd, ref):
    "Relative errors of one forward and one backward against the float64 reference; outputs start NaN."
    B, T, H, hd = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, T), float("nan"), device=q.device, dtype=torch.float32)
    o, lse = fwd(q, k, v, o, lse)
    grads = bwd(do, q, k, v, o, lse)
    out = dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
    bad = [name for name, t in out.items() if not t.isfinite().all()]
    if bad: raise ValueError(f"non-finite {bad} (unwritten rows?)")
    return {name: relative_error(t, r) for (name, t), r in zip(out.items(), ref)}

def elapsed(): return time.time() - T_START

def save(payload):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_math_variants.json"), "w") as f: json.dump(payload, f, indent=1)

def cpu_check():
    torch.manual_seed(0)
    cfg_f, cfg_b = dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=16, BLOCK_N=16)
    worst = 0.0
    for B, T, H, KV, hd in ((1, 37, 4, 2, 16), (2, 37, 4, 2, 32), (1, 50, 3, 3, 16), (2, 5, 2, 1, 16)):
        q, k, v, do = torch.randn(B, T, H, hd), torch.randn(B, T, KV, hd), torch.randn(B, T, KV, hd), torch.randn(B, T, H, hd)
        ref = reference_grads(q, k, v, do)
        for fname, fwd in (("baseline", FORWARDS["fwd baseline"]),
                           ("lazy", lambda q, k, v, o, lse: lazy_forward(q, k, v, o, lse, config=cfg_f))):
            for name, bwd in (("baseline bwd", BACKWARDS["bwd baseline"]),
                              ("atomic bwd", lambda *a: atomic_backward(*a, config=cfg_b))):   # (the interpreter has no TMA reduce)
                e = errors(q, k, v, do, fwd, bwd, ref)
                worst = max(worst, *e.values())
                print(f"B{B} T{T} H{H} KV{KV} hd{hd} {fname} + {name}: " + " ".join(f"{n} {x:.1e}" for n, x in e.items()))
        # the lazy rescale must also hold when maxima grow block after block (scores rising along the keys)
        k_rising = k + torch.linspace(0, 20, T)[None, :, None, None]
        ref = reference_grads(q, k_rising, v, do)
        e = errors(q, k_rising, v, do, lambda q, k, v, o, lse: lazy_forward(q, k, v, o, lse, config=cfg_f),
                   lambda *a: atomic_backward(*a, config=cfg_b), ref)
        worst = max(worst, *e.values())
        print("  rising keys, lazy + atomic: " + " ".join(f"{n} {x:.1e}" for n, x in e.items()))
    print(f"worst relative error {worst:.1e}")
    if worst > 1e-4: sys.exit("cpu check FAILED")

# ------------------------------------------------------------------------------------------------------------- GPU
def gpu_main():
    from torch.nn.attention import sdpa_kernel, SDPBackend
    dev, bf16 = "cuda", torch.bfloat16
    torch.manual_seed(0)
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, tau=TAU,
                   checks=[], timings=[], steps=[], notes=[])
    # autotune every kernel at the first timing shape of each head dim (the key holds no T), as benchmark_suite does
    for label in ("rb100m", "dense1b"):
        B, H, KV, T, hd = REFERENCE_ATTENTION_SHAPES[label]
        q, k, v, do = (torch.randn(B, T, n, hd, device=dev, dtype=bf16) for n in (H, KV, KV, H))
        for fname, fwd in FORWARDS.items():
            try: o, lse = fwd(q, k, v)
            except Exception as e: payload["notes"].append(f"{fname} at {label}: {one_line(e)}")
        o, lse = flash_attention_forward(q, k, v)
        for bname, bwd in BACKWARDS.items():
            try: bwd(do, q, k, v, o, lse)
            except Exception as e: payload["notes"].append(f"{bname} at {label}: {one_line(e)}")
        torch.cuda.synchronize()
        print(f"tuned at {label} ({elapsed():.0f} s)", flush=True)
    payload["configs"] = {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()} for name, kernel in
                          (("lazy forward", _lazy_tuned), ("atomic backward", _atomic_tuned))}
    payload["configs"].update({f"baseline {k}": {f"hd {hd} T {T}": str(tuned_config(k, hd, T)) for _, _, _, T, hd in REFERENCE_ATTENTION_SHAPES.values()}
                               for k in ("forward", "dkdv", "dq")})
    for name, cfgs in payload["configs"].items(): print(name, cfgs)
    ok = {}
    for hd, (B, T, H, KV) in CHECK_SHAPES.items():
        q, k, v, do = (torch.randn(B, T, n, hd, device=dev, dtype=bf16) for n in (H, KV, KV, H))
        ref = reference_grads(q, k, v, do)
        for fname, fwd in FORWARDS.items():
            for bname, bwd in BACKWARDS.items():
                if fname != "fwd baseline" and bname != "bwd baseline": continue     # each variant once, beside the other's baseline
                t0 = time.time()
                row = dict(forward=fname, backward=bname, hd=hd, shape=f"B{B} T{T} H{H} KV{KV}")
                try:
                    row.update(errors(q, k, v, do, fwd, bwd, ref))
                    row["ok"] = max(row[n] for n in ("o", "lse", "dq", "dk", "dv")) < 1e-2
                except Exception as e: row.update(ok=False, error=one_line(e))
                row["s"] = round(time.time() - t0, 1)
                for name in (fname, bname): ok[(name, hd)] = ok.get((name, hd), True) and row["ok"]
                payload["checks"].append(row)
                print(f"check hd{hd} {fname} + {bname}: " + (" ".join(f"{n} {row[n]:.1e}" for n in ("o", "lse", "dq", "dk", "dv"))
                      if "o" in row else row["error"]) + ("" if row["ok"] else "  FAILED") + f"  [{row['s']} s]", flush=True)
        save(payload)

    def cudnn(q, k, v, enable_gqa):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=enable_gqa).transpose(1, 2)

    for label, (B, H, KV, T, hd) in REFERENCE_ATTENTION_SHAPES.items():
        if elapsed() > TIME_GUARD_S: payload["notes"].append(f"{label}: skipped (time guard)"); continue
        q, k, v, do = (torch.randn(B, T, n, hd, device=dev, dtype=bf16) for n in (H, KV, KV, H))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        gqa = H != KV
        out = cudnn(qg, kg, vg, gqa)
        o, lse = flash_attention_forward(q, k, v)
        arms = {"cudnn fwd": lambda: cudnn(q, k, v, gqa),
                "cudnn bwd": lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)}
        for name, fwd in FORWARDS.items():
            if ok.get((name, hd)): fwd(q, k, v); arms[name] = (lambda f: lambda: f(q, k, v))(fwd)
        for name, bwd in BACKWARDS.items():
            if ok.get((name, hd)): bwd(do, q, k, v, o, lse); arms[name] = (lambda f: lambda: f(do, q, k, v, o, lse))(bwd)
        torch.cuda.synchronize()
        times = {name: [] for name in arms}
        for _ in range(ROUNDS):
            for name, fn in arms.items(): times[name].append(median_ms(fn))
        med = {name: statistics.median(t) for name, t in times.items()}
        flops = attention_flops(B, H, T, hd)
        for name, runs in times.items():
            fl = flops * (2.5 if "bwd" in name else 1.0)
            ref = med["cudnn bwd" if "bwd" in name else "cudnn fwd"]
            payload["timings"].append(dict(arm=name, shape=label, B=B, H=H, KV=KV, T=T, hd=hd, ms=med[name], rounds_ms=runs,
                                           tflops=fl / med[name] / 1e9, vs_cudnn=ref / med[name]))
        # the step: best forward + best backward of this shape, against cuDNN's forward + backward, alternating
        best_f = min((n for n in FORWARDS if n in med), key=med.get)
        best_b = min((n for n in BACKWARDS if n in med), key=med.get)
        def ours(f=FORWARDS[best_f], b=BACKWARDS[best_b]):
            o2, lse2 = f(q, k, v); return b(do, q, k, v, o2, lse2)
        def base(f=FORWARDS["fwd baseline"], b=BACKWARDS["bwd baseline"]):
            o2, lse2 = f(q, k, v); return b(do, q, k, v, o2, lse2)
        steps = {"cudnn": lambda: torch.autograd.grad(cudnn(qg, kg, vg, gqa), (qg, kg, vg), do), "baseline": base,
                 f"{best_f} + {best_b}": ours}
        st = {name: [] for name in steps}
        for _ in range(ROUNDS):
            for name, fn in steps.items(): st[name].append(median_ms(fn))
        ratios = [c / x for c, x in zip(st["cudnn"], st[f"{best_f} + {best_b}"])]
        for name, runs in st.items():
            payload["steps"].append(dict(arm=name, shape=label, ms=statistics.median(runs), rounds_ms=runs,
                                         tflops=3.5 * flops / statistics.median(runs) / 1e9,
                                         vs_cudnn=statistics.median(st["cudnn"]) / statistics.median(runs)))
        payload["steps"][-1]["round_ratios"] = ratios
        print(f"timed {label} at {elapsed():.0f} s", flush=True)
        q = k = v = do = qg = kg = vg = out = None   # freed (the lambdas hold the names)
        save(payload)

    for row in payload["checks"]:
        if not row["ok"]: print(f"FAILED check {row['forward']} + {row['backward']} hd{row['hd']}: {row.get('error', 'error >= 1e-2')}")
    for note in payload["notes"]: print("note:", note)
    print(f"\n{'arm':16s} {'shape':9s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}  (same direction: cuDNN ms / arm ms)")
    for r in payload["timings"]:
        print(f"{r['arm']:16s} {r['shape']:9s} {r['ms']:8.4f} {r['tflops']:8.1f} {r['vs_cudnn']:8.3f}")
    print(f"\n{'forward + backward':28s} {'shape':9s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}")
    for r in payload["steps"]:
        print(f"{r['arm']:28s} {r['shape']:9s} {r['ms']:8.4f} {r['tflops']:8.1f} {r['vs_cudnn']:8.3f}"
              + (f"  rounds {', '.join(f'{x:.3f}' for x in r['round_ratios'])}" if "round_ratios" in r else ""))
    payload["total_s"] = elapsed()
    print(f"total {elapsed():.0f} s")
    save(payload)

if __name__ == "__main__":
    if "--cpu-check" in sys.argv: cpu_check()
    elif not torch.cuda.is_available(): sys.exit("attention_math_variants: needs a CUDA GPU (or --cpu-check under TRITON_INTERPRET=1)")
    else: gpu_main()
