"""Where does the host time of one attention forward + backward go? At each reference shape, host microseconds to
enqueue a whole step: flash through the package (kernels launched by `rtrainer.kernels.launch`, and by Triton's
binding with DIRECT_LAUNCHES off), cuDNN through SDPA, and an autograd Function that launches nothing (ROUNDS rounds,
alternated, median; a 95% interval on direct / binding). At rb100m its parts: the package's forward, dQ and dK/dV
calls, the Hopper launchers, the Gluon forward launched by `kernel[grid](...)`, by its compiled launcher and by
`launch` with the descriptors built beforehand, the descriptors alone, an empty Triton kernel, and a cProfile of the
step. Run on the GPU: `python experiments/attention_host_cost.py` (writes $OUT/attention_host_cost.json and
$OUT/attention_host_cost_profile.txt when OUT is set)."""
import cProfile, io, json, os, pstats, statistics, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rtrainer.attention_hopper as hopper
from rtrainer import kernels as K
from rtrainer.kernels import alternation, ratio_interval
from rtrainer.attention import (flash_attention, flash_attention_forward, flash_backward_dq, flash_backward_dkdv,
                                attention_benchmark_inputs, REFERENCE_ATTENTION_SHAPES, _sdpa_attention)
from rtrainer.attention_hopper import _descriptor, FORWARD_TILES, CONSUMER_REGS, LOG2E, _sm_count

CALLS = int(os.environ.get("CALLS", 200))
ROUNDS = int(os.environ.get("ROUNDS", 7))

@triton.jit
def empty_kernel(x_ptr):
    pass

def host_us(fn, calls=CALLS):
    "Median over 5 batches of host microseconds per `fn()`, `calls` calls a batch, synchronised between batches."
    fn(); torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return sorted(times)[2]

def direct(jit_fn, grid, args, kwargs):
    "A function launching the compiled kernel with these arguments without Triton's binding (first launch compiles)."
    compiled = jit_fn[grid](*args, **kwargs)
    everything = (*args, *K._constant_tail(jit_fn, len(args), kwargs))
    stream = torch.cuda.current_stream().cuda_stream
    run, fn, meta = compiled.run, compiled.function, compiled.packed_metadata
    g = (*grid, 1, 1)[:3]
    return lambda: run(g[0], g[1], g[2], stream, fn, meta, None, None, None, *everything)

def parts_at(B, H, KV, T, hd):
    q, k, v, do, kr, vr = attention_benchmark_inputs(B, H, KV, T, hd)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    o, lse = flash_attention_forward(qd, kd, vd)
    dq, delta = flash_backward_dq(do, qd, kd, vd, o, lse)
    dk, dv = flash_backward_dkdv(do, qd, kd, vd, lse, delta)
    bm, bn, st = FORWARD_TILES[hd]
    n_pairs = K.cdiv(T, 2 * bm)
    programs = min(n_pairs * B * H, _sm_count(0))
    width, table = hopper._plan("forward", B, T, H, KV, hd, n_pairs, programs, qd.device)   # as hopper_forward launches it
    fwd_args = (_descriptor(qd, bm), _descriptor(kd, bn), _descriptor(vd, bn), _descriptor(o, bm), o, lse, *o.stride()[:3],
                H, T, H // KV, B * H, width, lse if table is None else table, n_pairs, LOG2E / hd ** 0.5)
    fwd_kw = dict(HEAD_DIM=hd, BLOCK_M=bm, BLOCK_N=bn, STAGES=st, TABLE=table is not None, REGS=CONSUMER_REGS, num_warps=4)
    jit_launch = lambda: hopper.hopper_forward_kernel[(programs,)](*fwd_args, **fwd_kw)
    direct_launch = direct(hopper.hopper_forward_kernel, (programs,), fwd_args, fwd_kw)
    direct_launch(); torch.cuda.synchronize()
    o2, lse2 = hopper.hopper_forward(qd, kd, vd)
    direct_launch(); torch.cuda.synchronize()          # overwrote o, lse with the same values
    same = bool(torch.equal(o, o2) and torch.equal(lse, lse2))
    x = torch.empty(16, device="cuda")
    parts = {
        "package forward (checks + Hopper)": lambda: flash_attention_forward(qd, kd, vd),
        "package dQ": lambda: flash_backward_dq(do, qd, kd, vd, o, lse),
        "package dK/dV": lambda: flash_backward_dkdv(do, qd, kd, vd, lse, delta),
        "hopper_forward (outputs given)": lambda: hopper.hopper_forward(qd, kd, vd, o, lse),
        "hopper_dkdv (outputs given)": lambda: hopper.hopper_dkdv(do, qd, kd, vd, lse, delta, dk, dv),
        "forward kernel[grid] (descriptors prebuilt)": jit_launch,
        "forward compiled.run (direct)": direct_launch,
        "forward K.launch (descriptors prebuilt)": lambda: K.launch(hopper.hopper_forward_kernel, (programs,), *fwd_args, **fwd_kw),
        "four descriptors": lambda: (_descriptor(qd, bm), _descriptor(kd, bn), _descriptor(vd, bn), _descriptor(o, bm)),
        "hopper_refusal": lambda: hopper.hopper_refusal(qd, kd, vd),
        "empty kernel[grid]": lambda: empty_kernel[(1,)](x),
        "empty kernel K.launch": lambda: K.launch(empty_kernel, (1,), x),
        "torch.empty (B,T,H,hd)": lambda: torch.empty(B, T, H, hd, dtype=q.dtype, device="cuda"),
    }
    return {name: round(host_us(fn), 1) for name, fn in parts.items()}, same

class EmptyFunction(torch.autograd.Function):
    "An autograd Function that launches nothing: the floor of a Python Function's forward + backward."
    @staticmethod
    def forward(ctx, q, k, v): return torch.empty_like(q)
    @staticmethod
    def backward(ctx, do): return torch.empty_like(do), None, None

def main():
    out = os.environ.get("OUT")
    steps = {}
    for name, (B, H, KV, T, hd) in REFERENCE_ATTENTION_SHAPES.items():
        q, k, v, do, kr, vr = attention_benchmark_inputs(B, H, KV, T, hd)
        cudnn = _sdpa_attention("CUDNN_ATTENTION", False)
        flash = lambda: torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do)
        def bound():
            K.DIRECT_LAUNCHES = False
            try: flash()
            finally: K.DIRECT_LAUNCHES = True
        arms = {"flash": flash, "flash, Triton's binding": bound,
                "cudnn": lambda: torch.autograd.grad(cudnn(q, kr, vr), (q, kr, vr), do),
                "empty Function": lambda: torch.autograd.grad(EmptyFunction.apply(q, k, v), (q,), do)}
        times = {a: [] for a in arms}
        for r in range(ROUNDS):
            for a in alternation(arms, r): times[a].append(host_us(arms[a], calls=50))
        steps[name] = {a: round(statistics.median(t), 1) for a, t in times.items()}
        steps[name]["direct / binding"] = ratio_interval([d / b for d, b in zip(times["flash"], times["flash, Triton's binding"])])
        print(name, "host us a step", steps[name], flush=True)
        if name == "rb100m":
            profile = cProfile.Profile(); profile.enable()
            for _ in range(300): flash()
            profile.disable(); torch.cuda.synchronize()
            text = io.StringIO(); pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
            print(text.getvalue()[:3000], flush=True)
            if out: open(os.path.join(out, "attention_host_cost_profile.txt"), "w").write(text.getvalue())
    result = dict(triton=triton.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name(), calls=CALLS,
                  rounds=ROUNDS, commit=os.environ.get("RTRAINER_COMMIT"), step_host_us=steps)
    if out: json.dump(result, open(os.path.join(out, "attention_host_cost.json"), "w"), indent=1)   # kept if the parts fail
    parts, same = parts_at(*REFERENCE_ATTENTION_SHAPES["rb100m"])
    result.update(rb100m_parts_us=parts, direct_launch_same_output=same)
    if out: json.dump(result, open(os.path.join(out, "attention_host_cost.json"), "w"), indent=1)
    print("\ndirect launch gives the same output:", same)
    print(f"{'rb100m part':48s} {'host us':>8s}")
    for k, v in parts.items(): print(f"{k:48s} {v:8.1f}")
    print(f"\n{'shape':10s} {'flash':>8s} {'binding':>8s} {'cudnn':>8s} {'empty Fn':>8s}  direct / binding")
    for k, v in steps.items():
        bound = v["flash, Triton's binding"]
        print(f"{k:10s} {v['flash']:8.1f} {bound:8.1f} {v['cudnn']:8.1f} {v['empty Function']:8.1f}  "
              "%.3f [%.3f, %.3f]" % v["direct / binding"])

if __name__ == "__main__":
    main()
