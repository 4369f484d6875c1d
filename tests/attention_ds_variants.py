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
`python tests/attention_ds_variants.py` on a GPU (writes data/results/attention_ds_variants.json, a copy in $OUT)."""
import json, os, shutil, sys, time
import torch
import rtrainer.attention as A
from rtrainer.attention import (fused_qkv_views, flash_attention_forward, flash_attention_backward, flash_attention,
                                attention_flops, attention_reference, REFERENCE_ATTENTION_SHAPES, SWEEP_TOKENS, SWEEP_HEADS)
from rtrainer.kernels import median_ms, ratio_interval, relative_error, save_results

ROUNDS = 3
REP_MS = 60
SHAPES = tuple(os.environ.get("DS_SHAPES", "rb100m,prof183m,dense1b,moe4b,T2048,T4096,T8192").split(","))
DQ_DS_CONFIGS = [(64, 64, 4, 3, None), (128, 64, 8, 3, None), (64, 32, 4, 3, None), (128, 128, 8, 3, None), (128, 64, 4, 3, None)]
CHECKS = [(2, 1000, 12, 4, 64, True), (1, 777, 16, 16, 128, True), (2, 513, 8, 1, 64, True), (1, 300, 4, 2, 128, False),
          (1, 4099, 4, 2, 64, True)]

FAILED = {}                                             # (head-dim class, config) -> why it did not compile or run

def dims(shape):
    if shape in REFERENCE_ATTENTION_SHAPES: return REFERENCE_ATTENTION_SHAPES[shape]
    T = int(shape[1:]); H, KV, hd = SWEEP_HEADS
    return max(1, SWEEP_TOKENS // T), H, KV, T, hd

def with_dq_config(c, hd, T):
    "Set the 'dq_ds' config of this shape's class (the launchers read TUNED_CONFIGS at every call)."
    A.TUNED_CONFIGS["dq_ds"][A._length_class(hd, T)] = c

def checks():
    rows = []
    for B, T, H, KV, hd, causal in CHECKS:
        q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
        do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
        o, lse = flash_attention_forward(q, k, v, causal)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = torch.autograd.grad(attention_reference(q64, k64, v64, causal), (q64, k64, v64), do.double())
        base = flash_attention_backward(do, q, k, v, o, lse, causal, dq_from="recompute")
        for c in DQ_DS_CONFIGS:
            with_dq_config(c, hd, T)
            for budget in (None, 1):                    # 1 byte: one KV head per chunk
                nan = lambda *s: torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda")
                if (A._length_class(hd, T)[0], c) in FAILED: continue
                try:
                    got = flash_attention_backward(do, q, k, v, o, lse, causal, dq=nan(B, T, H, hd), dk=nan(B, T, KV, hd),
                                                   dv=nan(B, T, KV, hd), dq_from="ds", ds_budget=budget)
                except Exception as e:                  # out of shared memory, say: listed, not timed
                    FAILED[(A._length_class(hd, T)[0], c)] = f"{type(e).__name__}: {str(e)[:160]}"
                    print("did not run:", hd, c, FAILED[(A._length_class(hd, T)[0], c)], flush=True)
                    continue
                errs = {n: relative_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), got, ref)}
                same_dkdv = torch.equal(got[1], base[1]) and torch.equal(got[2], base[2])
                ok = all(g.isfinite().all() for g in got) and max(errs.values()) < 1e-2
                rows.append(dict(B=B, T=T, H=H, KV=KV, hd=hd, causal=causal, config=c, budget=budget, ok=ok,
                                 dkdv_equal_to_recompute=same_dkdv, **errs))
                if not ok: print("FAILED", rows[-1], flush=True)
        mine = [r for r in rows if (r["B"], r["T"], r["H"], r["hd"]) == (B, T, H, hd)]
        print(f"check B{B} T{T} H{H}/{KV} hd{hd} causal={causal}: recompute dq {relative_error(base[0], ref[0]):.1e}, "
              f"ds worst {max(max(r['dq'], r['dk'], r['dv']) for r in mine):.1e}, dK/dV equal to recompute's: "
              f"{all(r['dkdv_equal_to_recompute'] for r in mine)}", flush=True)
    with_dq_config(DQ_DS_CONFIGS[0], 64, 1024); with_dq_config(DQ_DS_CONFIGS[0], 128, 1024)
    with_dq_config(DQ_DS_CONFIGS[0], 64, 8192); with_dq_config(DQ_DS_CONFIGS[0], 128, 8192)
    return rows

def cudnn(H, KV):
    fn = A._sdpa_attention("CUDNN_ATTENTION", H != KV)
    return fn

def time_shape(shape):
    B, H, KV, T, hd = dims(shape)
    q, k, v = (t.requires_grad_() for t in fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda"))
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_attention_forward(q.detach(), k.detach(), v.detach())
    arms = {"recompute": (dict(dq_from="recompute"), None)}
    for c in DQ_DS_CONFIGS:
        if (A._length_class(hd, T)[0], c) not in FAILED: arms[f"ds {c[0]}x{c[1]}/w{c[2]}/s{c[3]}"] = (dict(dq_from="ds"), c)
    arms["ds, one chunk"] = (dict(dq_from="ds", ds_budget=1 << 40), DQ_DS_CONFIGS[0])
    if T >= 4096: arms["ds, 2 GiB chunks"] = (dict(dq_from="ds", ds_budget=2 << 30), DQ_DS_CONFIGS[0])
    flops = 2.5 * attention_flops(B, H, T, hd)
    times, peaks = {a: [] for a in arms}, {}
    for r in range(ROUNDS):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for a in order:
            kw, c = arms[a]
            if c: with_dq_config(c, hd, T)
            fn = lambda: flash_attention_backward(do, q.detach(), k.detach(), v.detach(), o, lse, True, **kw)
            if r == 0:
                fn(); torch.cuda.synchronize()
                base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
                fn(); torch.cuda.synchronize()
                peaks[a] = (torch.cuda.max_memory_allocated() - base) / 2**20
            times[a].append(median_ms(fn, rep_ms=REP_MS))
    rows = []
    for a in arms:
        ms = sorted(times[a])[ROUNDS // 2]
        ratio, low, high = ratio_interval([b / t for b, t in zip(times["recompute"], times[a])])
        rows.append(dict(shape=shape, B=B, H=H, KV=KV, T=T, hd=hd, arm=a, bwd_ms=ms, bwd_tflops=flops / ms / 1e9,
                         speedup_vs_recompute=ratio, ci95=(low, high), peak_mib=peaks[a], rounds_ms=times[a]))
        print(f"{shape:9} {a:24} bwd {ms:.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  x{ratio:.3f} [{low:.3f}, {high:.3f}]  "
              f"peak +{peaks[a]:.0f} MiB", flush=True)
    with_dq_config(DQ_DS_CONFIGS[0], hd, T)
    return rows

def versus_cudnn(shape, best_config):
    "Forward + backward: recompute, the best 'ds' config, cuDNN; alternated rounds."
    B, H, KV, T, hd = dims(shape)
    q, k, v = (t.requires_grad_() for t in fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda"))
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    fn_cudnn = cudnn(H, KV)
    def step(mode):
        def run():
            if mode == "cudnn": out = fn_cudnn(q, k, v)
            else:
                A.BACKWARD_DQ_FROM[A._length_class(hd, T)] = mode
                out = flash_attention(q, k, v)
            return torch.autograd.grad(out, (q, k, v), do)
        return run
    with_dq_config(best_config, hd, T)
    saved = dict(A.BACKWARD_DQ_FROM)
    arms = {"recompute": step("recompute"), "ds": step("ds"), "cudnn": step("cudnn")}
    times = {a: [] for a in arms}
    for r in range(ROUNDS):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            times[a].append(median_ms(arms[a], rep_ms=REP_MS))
    A.BACKWARD_DQ_FROM.update(saved)
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
        ds_rows = [r for r in rows if r["arm"].startswith("ds ") and "chunk" not in r["arm"]]
        best = min(ds_rows, key=lambda r: r["bwd_ms"])
        config = DQ_DS_CONFIGS[[f"ds {c[0]}x{c[1]}/w{c[2]}/s{c[3]}" for c in DQ_DS_CONFIGS].index(best["arm"])]
        versus_rows += versus_cudnn(shape, config)
        print(f"--- {shape} done at {time.time() - t0:.0f} s", flush=True)
    path = save_results("attention_ds_variants", dict(checks=check_rows, backward=bwd_rows, versus_cudnn=versus_rows),
                        rounds=ROUNDS, dq_ds_configs=DQ_DS_CONFIGS, ds_budget_bytes=A.DS_BUDGET_BYTES,
                        did_not_run={f"hd{k[0]} {k[1]}": v for k, v in FAILED.items()})
    if os.environ.get("OUT"): shutil.copy(path, os.environ["OUT"])
    print("\n=== forward + backward against cuDNN (TFLOP/s, speed ratio [95%])")
    for shape in SHAPES:
        r = {x["arm"]: x for x in versus_rows if x["shape"] == shape}
        print(f"{shape:9} recompute {r['recompute']['fwd_bwd_tflops']:6.1f} x{r['recompute']['speed_vs_cudnn']:.3f}   "
              f"ds {r['ds']['fwd_bwd_tflops']:6.1f} x{r['ds']['speed_vs_cudnn']:.3f} [{r['ds']['ci95'][0]:.3f}, {r['ds']['ci95'][1]:.3f}] "
              f"{r['ds']['config']}   cuDNN {r['cudnn']['fwd_bwd_tflops']:6.1f}")
