"""Block-size sweep of rtrainer's three flash-attention kernels (forward, dQ, dK/dV) on the GPU, beyond the four or
five configs each autotuned list holds: tile shapes, warps, pipeline depth and register caps (maxnreg), at the
reference shapes of the attention chapter.

Configs are compiled first in parallel worker processes (Triton's on-disk cache then serves the timing process),
every config is checked against the autotuned package path on the shape it is timed at, and the arms of one kernel
alternate over ROUNDS rounds. A config that does not compile (shared memory) or disagrees is listed, not timed.
`python experiments/attention_configs.py` on a GPU (writes $OUT/attention_configs.json when OUT is set; ATTN_CONFIG_KERNELS=
forward,dq limits the kernels; ATTN_CONFIG_SHAPES=rb100m,T8192 picks the shapes: reference names, or T<length> for the
benchmark's sweep heads at that length); `python experiments/attention_configs.py --list` prints the candidates and shapes."""
import json, os, statistics, sys, time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp

ROUNDS = 3
WORKERS = 12
SHAPES = tuple(os.environ.get("ATTN_CONFIG_SHAPES", "rb100m,prof183m,dense1b,moe4b").split(","))

def shape_dims(shape):
    """(B, H, KV, T, hd) of a reference shape's name, of 'T<length>' (the sweep's heads at 32K tokens per batch) or of
    'h128T<length>' (16 heads of 128 at 16K tokens, the Hopper benchmark's head-dim-128 sweep)."""
    from rtrainer.attention import REFERENCE_ATTENTION_SHAPES, SWEEP_TOKENS, SWEEP_HEADS
    if shape in REFERENCE_ATTENTION_SHAPES: return REFERENCE_ATTENTION_SHAPES[shape]
    wide, _, length = shape.partition("T")
    if wide in ("", "h128") and length.isdigit():
        T = int(length)
        if wide: return max(1, 16384 // T), 16, 16, T, 128
        H, KV, hd = SWEEP_HEADS
        return max(1, SWEEP_TOKENS // T), H, KV, T, hd
    raise ValueError(f"unknown attention shape {shape!r}: use {list(REFERENCE_ATTENTION_SHAPES)}, T<length> or h128T<length>")
# (BLOCK_M, BLOCK_N, warps, stages, maxnreg or None). forward and dQ need BLOCK_M % BLOCK_N == 0, dK/dV BLOCK_N % BLOCK_M == 0.
# A cap of 128 lets two 8-warp programs (or four 4-warp ones) share an SM's 64K registers; 168 lets three 4-warp ones.
# The last two or three of each list were added after the first run, for head dim 128, where compiled for sm_90 with
# Triton 3.6 they hold fewer registers than the winners: the dK/dV 32 x 64 tile spills 220 bytes at 255 registers,
# 32 x 32 and 16 x 32 do not spill (234 and 206); the forward's 64 x 32 tile takes 132 registers and 64 KB of shared
# memory, so three programs fit per SM where the 64 x 64 tile (178 registers, 112 KB) fits two.
CANDIDATES = {
    "forward": [(128, 64, 8, 3, None), (128, 64, 8, 2, 128), (128, 64, 8, 3, 128), (128, 128, 8, 2, None),
                (128, 128, 8, 3, None), (128, 32, 8, 3, None), (128, 32, 8, 4, None), (64, 64, 4, 3, None),
                (64, 64, 4, 4, None), (64, 64, 4, 3, 168), (64, 32, 4, 4, None), (128, 64, 4, 3, None),
                (128, 64, 8, 4, None), (128, 128, 8, 2, 128), (64, 32, 4, 3, None), (64, 16, 4, 3, None),
                (64, 32, 4, 2, None), (64, 32, 4, 3, 168)],
    "dq": [(64, 32, 4, 3, None), (64, 64, 4, 3, None), (64, 64, 4, 4, None), (128, 64, 8, 3, None),
           (128, 32, 8, 3, None), (64, 32, 4, 4, None), (128, 64, 8, 2, None), (64, 64, 8, 3, None),
           (128, 128, 8, 2, None), (64, 32, 4, 5, None), (64, 64, 4, 3, 168), (128, 64, 8, 3, 128), (64, 16, 4, 3, None),
           (64, 32, 8, 3, None)],
    "dkdv": [(32, 64, 4, 3, None), (64, 64, 4, 3, None), (64, 64, 4, 4, None), (64, 128, 8, 3, None),
             (32, 128, 8, 3, None), (32, 128, 4, 3, None), (64, 64, 8, 3, None), (64, 64, 8, 2, None),
             (32, 64, 4, 4, None), (32, 64, 4, 5, None), (16, 64, 4, 3, None), (32, 128, 8, 4, None),
             (64, 128, 8, 2, None), (32, 64, 4, 3, 168), (32, 32, 4, 3, None), (16, 32, 4, 3, None),
             (32, 32, 4, 4, None), (32, 32, 4, 2, None), (16, 32, 4, 4, None)],
}

def valid(kernel, c):
    return c[1] % c[0] == 0 if kernel == "dkdv" else c[0] % c[1] == 0

def config_name(c):
    return f"{c[0]}/{c[1]} w{c[2]} s{c[3]}" + (f" r{c[4]}" if c[4] else "")

def inputs(shape, device="cuda"):
    import torch
    from rtrainer.attention import fused_qkv_views, flash_attention_forward
    B, H, KV, T, hd = shape_dims(shape)
    torch.manual_seed(0)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, device)
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device=device)
    o, lse = flash_attention_forward(q, k, v, True)
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, delta=torch.empty(B, H, T, device=device, dtype=torch.float32),
                dq=torch.empty(B, T, H, hd, dtype=q.dtype, device=device), dk=torch.empty(B, T, KV, hd, dtype=q.dtype, device=device),
                dv=torch.empty(B, T, KV, hd, dtype=q.dtype, device=device), out=torch.empty(B, T, H, hd, dtype=q.dtype, device=device),
                lse_out=torch.empty_like(lse))

def launch(kernel, c, t):
    "One launch of `kernel` with config c on the tensors t, through rtrainer's launchers (dQ also writes delta for dK/dV)."
    from rtrainer.attention import flash_attention_forward, flash_backward_dq, flash_backward_dkdv
    config = dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3], **({"maxnreg": c[4]} if c[4] else {}))
    q, k, v, do = t["q"], t["k"], t["v"], t["do"]
    if kernel == "forward": flash_attention_forward(q, k, v, True, o=t["out"], lse=t["lse_out"], config=config)
    elif kernel == "dq": flash_backward_dq(do, q, k, v, t["o"], t["lse"], True, dq=t["dq"], delta=t["delta"], config=config)
    else: flash_backward_dkdv(do, q, k, v, t["lse"], t["delta"], True, dk=t["dk"], dv=t["dv"], config=config)

def compile_some(jobs):
    "Worker: launch each (kernel, config, shape) once so that Triton compiles and caches it; [(job, error or '')]."
    import torch
    done, tensors = [], {}
    for kernel, c, shape in jobs:
        try:
            if shape not in tensors: tensors[shape] = inputs(shape)
            launch(kernel, c, tensors[shape]); torch.cuda.synchronize(); done.append(((kernel, c, shape), ""))
        except Exception as e:   # out of shared memory, a register cap ptxas refuses, ...
            done.append(((kernel, c, shape), f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
    return done

def main():
    kernels = [k for k in os.environ.get("ATTN_CONFIG_KERNELS", "forward,dq,dkdv").split(",") if k]
    if "--list" in sys.argv:
        for k in kernels: print(k, [config_name(c) for c in CANDIDATES[k] if valid(k, c)])
        print("shapes", {s: shape_dims(s) for s in SHAPES})
        return
    import torch
    from rtrainer.attention import flash_attention_backward, attention_flops
    from rtrainer.kernels import median_ms, relative_error
    t_start = time.time()
    # every shape: Triton specializes integer arguments (H divisible by 16, a group of 1), so shapes share few binaries
    jobs = [(k, c, s) for k in kernels for c in CANDIDATES[k] if valid(k, c) for s in SHAPES]
    chunks = [jobs[i::WORKERS] for i in range(WORKERS)]
    failed = {}
    with ProcessPoolExecutor(WORKERS, mp_context=mp.get_context("spawn")) as pool:
        for result in pool.map(compile_some, chunks):
            for (k, c, s), err in result:
                if err: failed[(k, c, shape_dims(s)[4])] = err
    print(f"compiled {len(jobs)} kernels in {time.time() - t_start:.0f} s; {len(failed)} failed", flush=True)
    for key, err in failed.items(): print("  failed:", key[0], config_name(key[1]), f"hd{key[2]}", err)
    rows, checks = [], []
    for shape in SHAPES:
        t = inputs(shape)
        B, H, KV, T, hd = shape_dims(shape)
        ref_dq, ref_dk, ref_dv = flash_attention_backward(t["do"], t["q"], t["k"], t["v"], t["o"], t["lse"], True)
        ref_delta = (t["o"].float() * t["do"].float()).sum(-1).transpose(1, 2)
        flops = attention_flops(B, H, T, hd, True)
        for kernel in kernels:
            arms = []
            for c in CANDIDATES[kernel]:
                if not valid(kernel, c) or (kernel, c, hd) in failed: continue
                for name in ("out", "dq", "dk", "dv"): t[name].fill_(float("nan"))
                if kernel == "dq": t["delta"].fill_(float("nan"))     # dQ must write it ...
                else: t["delta"].copy_(ref_delta)                     # ... dK/dV reads it
                launch(kernel, c, t); torch.cuda.synchronize()
                got = dict(forward=[(t["out"], t["o"])], dq=[(t["dq"], ref_dq), (t["delta"], ref_delta)],
                           dkdv=[(t["dk"], ref_dk), (t["dv"], ref_dv)])[kernel]
                err = max(relative_error(a, b) for a, b in got)
                ok = all(a.isfinite().all().item() for a, _ in got) and err < 1e-2
                checks.append(dict(kernel=kernel, config=config_name(c), shape=shape, err=err, ok=ok))
                if ok: arms.append(c)
                else: print(f"  {shape} {kernel} {config_name(c)}: disagrees with the package path (error {err:.2e})")
            times = {c: [] for c in arms}
            for _ in range(ROUNDS):
                for c in arms: times[c].append(median_ms(lambda: launch(kernel, c, t), rep_ms=60))
            work = flops * (1.0 if kernel == "forward" else 1.25)     # backward = 2.5 x forward, split as 1.25 + 1.25 here
            best = min(statistics.median(v) for v in times.values()) if times else float("nan")
            for c, v in times.items():
                ms = statistics.median(v)
                rows.append(dict(shape=shape, hd=hd, kernel=kernel, config=config_name(c), ms=ms, rounds_ms=v,
                                 nominal_tflops=work / ms / 1e9, vs_best=best / ms))
            ranked = sorted((r for r in rows if r["shape"] == shape and r["kernel"] == kernel), key=lambda r: r["ms"])
            print(f"{shape} hd{hd} {kernel}: " + ", ".join(f"{r['config']} {r['ms']:.3f}" for r in ranked[:5]), flush=True)
        t = None   # freed (the lambdas hold the name)
        torch.cuda.empty_cache()
    payload = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=__import__("triton").__version__, rounds=ROUNDS, rows=rows, checks=checks,
                   failed=[dict(kernel=k, config=config_name(c), hd=hd, error=e) for (k, c, hd), e in failed.items()],
                   note="nominal_tflops counts the forward's FLOPs for the forward and half the backward's (1.25 x forward) "
                        "for each of dQ and dK/dV; dQ's real work is 3 tile matmuls, dK/dV's 4.",
                   total_s=time.time() - t_start)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_configs.json"), "w") as f: json.dump(payload, f, indent=1)
    print(f"\n{'shape':9} {'kernel':8} {'best config':22} {'ms':>7} {'rtrainer runs':22} {'ms':>7}")
    from rtrainer.attention import tuned_config
    for shape in SHAPES:
        _, _, _, T, hd = shape_dims(shape)
        for kernel in kernels:
            rs = sorted((r for r in rows if r["shape"] == shape and r["kernel"] == kernel), key=lambda r: r["ms"])
            if not rs: continue
            c = tuned_config(kernel, hd, T)
            ours = config_name((c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"], c.get("maxnreg")))
            listed = [r for r in rs if r["config"] == ours]
            lb = listed[0] if listed else dict(config=ours + " (not swept)", ms=float("nan"))
            print(f"{shape:9} {kernel:8} {rs[0]['config']:22} {rs[0]['ms']:7.3f} {lb['config']:22} {lb['ms']:7.3f}")
    print(f"total {time.time() - t_start:.0f} s")

if __name__ == "__main__":
    main()
