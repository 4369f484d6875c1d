"""Where does one MoE layer step go, beyond its six expert GEMMs? One GPU run (about a minute) profiles a forward +
backward at the moe4b shape (16,384 tokens, D 3072, FF 4096, 8 experts, top-2, bf16) for the library capacity arm
(what `auto` runs), for torch.compile of the capacity reference and for the dropless arms on `_grouped_mm` (what
`auto` runs) and per expert, and prints each arm's unprofiled step time and its GPU kernels grouped as GEMMs and the rest, per step (5 profiled steps after warm-up). Then it times the router's kernels at that shape over their block sizes,
against PyTorch's fp32 products. Writes $OUT/moe_profile.json.
`python experiments/moe_profile.py` on a GPU; PROFILE_ARMS="arm;arm" picks arms (of moe.BENCHMARK_ARMS or EXTRA_ARMS below),
ROUTER=0 skips the router sweep, PLAN=0 the routing plans' timing."""
import json, os, sys
from collections import defaultdict
import torch
from rtrainer.kernels import knob_values, median_ms
from rtrainer import moe
from rtrainer import moe_hopper  # noqa: F401 (registers the Hopper GEMM, 03a; the "bmm only" arm turns it off)

STEPS = 5
ARMS = ("library capacity", "library capacity, bmm only", "torch.compile capacity", "library dropless", "per-expert dropless")
EXTRA_ARMS = {   # the weight gradient on the other backend: the TMA kernel on capacity groups, cuBLAS per expert on dropless ones
    "library capacity, TMA weight gradient": ("capacity", "triton", {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "triton"}),
    "library dropless, per-expert weight gradient": ("dropless", "triton", {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "per_expert"}),
}

def is_gemm(name):
    n = name.lower()
    return any(s in n for s in ("gemm", "weight_grad", "sm90_xmma", "cutlass", "nvjet", "_mm_", "bmm", "matmul", "wgmma"))

def profile_arm(step):
    for _ in range(3): step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS): step()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            kernels[e.name][0] += e.device_time / STEPS / 1e3          # ms per step
            kernels[e.name][1] += 1
    return {name: dict(ms=ms, calls=calls // STEPS) for name, (ms, calls) in kernels.items()}

def router_sweep(x):
    """The router's kernels at x's shape: forward (logits) and backward (drouter, and dx alone through the combine kernel's
    router term), PyTorch's fp32 products first, then the Triton kernels per block size."""
    N, D = x.shape
    r = (torch.randn(D, 8, device="cuda") * 0.02).requires_grad_()
    xg = x.clone().requires_grad_()
    g = torch.randn(N, 8, device="cuda")
    no_rows = torch.full((N, 1), -1, dtype=torch.int32, device="cuda")
    zero_row = torch.zeros(1, D, dtype=x.dtype, device="cuda")
    logits = moe.RouterLogits.apply(xg, r)
    rows_out = [dict(arm="torch fp32 (RouterLogits)", fwd_ms=median_ms(lambda: moe.RouterLogits.apply(xg, r)),
                     bwd_ms=median_ms(lambda: torch.autograd.grad(logits, (xg, r), g, retain_graph=True)))]
    arms = {}
    for rows, cols in ((32, 128), (64, 128), (128, 64), (64, 64)):
        arms[f"triton rows {rows} cols {cols}"] = dict(ROUTER_BLOCK_ROWS=rows, ROUTER_BLOCK_COLS=cols)
    for tile in ((32, 128), (16, 256), (64, 64), (32, 256)):
        arms[f"dx tile {tile}"] = dict(COMBINE_ROUTER_TILE=tile)
    for name, knobs in arms.items():
        with knob_values(moe, knobs):
            row = dict(arm=name, **{k: list(v) if isinstance(v, tuple) else v for k, v in knobs.items()})
            if "COMBINE_ROUTER_TILE" not in knobs:
                row["fwd_ms"] = median_ms(lambda: moe.router_logits_triton(x, r.detach()))
                row["drouter_ms"] = median_ms(lambda: moe.router_weight_grad_triton(x, g, r.detach()))
            row["dx_ms"] = median_ms(lambda: moe.combine_rows_triton(zero_row, no_rows, out_dtype=x.dtype, router_grad=(g, r.detach())))
        rows_out.append(row)
    print(f"\n{'router':40s} {'fwd ms':>8s} {'bwd ms':>8s} {'drouter':>8s} {'dx':>8s}")
    for row in rows_out:
        print(f"{row['arm']:40s} " + " ".join(f"{row[k]:8.4f}" if k in row else f"{'':8s}" for k in ("fwd_ms", "bwd_ms", "drouter_ms", "dx_ms")))
    return rows_out

def plan_sweep(x, n_experts=8, top_k=2):
    "The routing plans at x's shape: the capacity kernel, the dropless argsort reference and the dropless kernel per count step."
    torch.manual_seed(1)
    experts = torch.rand(x.shape[0], n_experts, device="cuda").topk(top_k, dim=-1).indices
    arms = {"capacity_plan (kernel)": ({}, lambda: moe.capacity_plan(experts, n_experts, 1.0)),
            "dropless_plan_reference, row_align 128": ({}, lambda: moe.dropless_plan_reference(experts, n_experts, 128))}
    for elements in (8192, 16384, 32768):
        arms[f"dropless_plan, row_align 128, count step {elements}"] = (
            {"PLAN_COUNT_ELEMENTS": elements}, lambda: moe.dropless_plan(experts, n_experts, 128))
    rows = []
    for name, (knobs, fn) in arms.items():
        with knob_values(moe, knobs): rows.append(dict(arm=name, ms=median_ms(fn)))
    print(f"\n{'plan':50s} {'ms':>8s}")
    for row in rows: print(f"{row['arm']:50s} {row['ms']:8.4f}")
    return rows

def main():
    if not torch.cuda.is_available(): sys.exit("moe_profile: needs a CUDA GPU")
    N, D, FF, E, k = 16_384, 3072, 4096, 8, 2
    torch.manual_seed(0)
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
    grad_y = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    out = {"step_ms": {}}
    arms = os.environ["PROFILE_ARMS"].split(";") if os.environ.get("PROFILE_ARMS") else ARMS
    for arm in arms:
        dispatch, impl, knobs = {**moe.BENCHMARK_ARMS, **EXTRA_ARMS}[arm]
        layer = moe.MoeFeedForward(D, FF, E, k, dispatch=dispatch, impl=impl, dtype=torch.bfloat16, device="cuda")
        module = torch.compile(layer) if arm.startswith("torch.compile") else layer
        params = list(layer.parameters())
        def step():
            with knob_values(moe.MOE_KNOBS, knobs): moe._moe_layer_step(module, x, grad_y, params)
        kernels = profile_arm(step)
        out[arm] = kernels
        step_ms = out["step_ms"][arm] = median_ms(step)   # the unprofiled step, beside its kernels' sum
        gemm = sum(v["ms"] for n, v in kernels.items() if is_gemm(n))
        rest = sum(v["ms"] for n, v in kernels.items() if not is_gemm(n))
        print(f"\n== {arm}: step {step_ms:.3f} ms; kernels {gemm + rest:.3f} ms per step = GEMMs {gemm:.3f} + other {rest:.3f}")
        for name, v in sorted(kernels.items(), key=lambda kv: -kv[1]["ms"])[:28]:
            print(f"  {v['ms']:7.3f} ms  x{v['calls']:<3d} {'GEMM ' if is_gemm(name) else '     '}{name[:110]}")
    if os.environ.get("ROUTER", "1") != "0": out["router_sweep"] = router_sweep(x.detach())
    if os.environ.get("PLAN", "1") != "0": out["plan_sweep"] = plan_sweep(x.detach())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_profile.json"), "w") as f: json.dump(out, f, indent=1)

if __name__ == "__main__":
    main()
