"""Can a Triton GEMM match cuBLAS on the MoE layer's expert GEMMs, and does a SwiGLU epilogue then pay?

The MoE chapter's profile splits a moe4b layer step into 9.91 ms of expert GEMMs (cuBLAS batched, capacity path) and
1.80 ms of everything else; 1.15x torch.compile needs the SwiGLU inside the GEMM epilogues and the row gathers inside
their loads, which means GEMMs of our own at cuBLAS speed. rtrainer's grouped GEMM (pointer loads, one tile per
program) is 12-15% slower than cuBLAS there. This script times, at the capacity shapes of moe4b (8 experts x 4,096
rows, D 3072, FF 4096, bf16), the six GEMMs of a layer step (GEMMS=gate_up,down,gate_up dgrad,down dgrad,gate_up wgrad,
down wgrad picks some; the weight gradients against the library path's bmm into fp32, out_dtype=float32):

  cublas              torch.bmm over (E, C, K) x (E, K, N), what the library capacity path runs
  grouped             rtrainer.moe.grouped_gemm_triton (autotuned, pointer loads)
  tma <cfg>           a Triton GEMM through host-built TMA descriptors: one tile per program (tiles), or a persistent
                      grid of one program per SM walking the tiles (persistent), optionally with the tile loop
                      flattened into the K loop so the pipeline runs across tiles (flat); for the input gradient
                      it reads the weight's tiles and transposes them in shared memory, and for the weight
                      gradient it reads the rows' tiles transposed and writes fp32 (as main_grad is)
and, for the gate_up GEMM, the SwiGLU:
  cublas + swiglu     bmm, then rtrainer's swiglu_forward kernel (what the layer runs)
  tma + swiglu epi    one kernel: gate and up tiles in two accumulators, writes gate_up and silu(gate) * up

Every arm is checked against float64 on 512 rows of the first and last expert before it is timed; arms alternate
over ROUNDS rounds; ratios to cuBLAS carry a 95% interval. A variant that does not compile is listed with its error.
`python experiments/moe_gemm_variants.py` on a GPU (writes $OUT/moe_gemm_variants.json when OUT is set);
`python experiments/moe_gemm_variants.py --compile` compiles the TMA variants for sm_90 without a GPU (run it under the
GPU's Triton) and prints shared memory and registers."""
import json, os, sys, time, inspect
import torch
import triton
import triton.language as tl

E, C, D, FF = 8, 4096, 3072, 4096
ROUNDS = 5
NUM_SMS = 132

@triton.jit
def _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    "Grouped ordering: GROUP_M row tiles sweep the columns together, so their B tiles are shared in L2."
    width = GROUP_M * n_tiles_n
    first_m = (tile // width) * GROUP_M
    size_m = min(n_tiles_m - first_m, GROUP_M)
    return first_m + (tile % width) % size_m, (tile % width) // size_m

@triton.jit
def tma_gemm_kernel(a_desc, b_desc, c_desc,        # a (E*C, K), b (E*K, N) = one (K, N) matrix per expert, c (E*C, N);
                    M, N, K, ROWS_PER_GROUP, N_PROGRAMS,   # with B_TRANSPOSED, b is (E*N, K) and the kernel multiplies by its transpose
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr, B_TRANSPOSED: tl.constexpr = False):
    n_tiles_m, n_tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, N_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        expert = off_m // ROWS_PER_GROUP                 # this tile's expert (a tile never straddles two)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if B_TRANSPOSED: b = b_desc.load([expert * N + off_n, k]).T
            else: b = b_desc.load([expert * K + k, off_n])
            acc = tl.dot(a_desc.load([off_m, k]), b, acc)
        c_desc.store([off_m, off_n], acc.to(tl.bfloat16))

@triton.jit
def tma_weight_grad_kernel(a_desc, dc_desc, dw_ptr,   # a (E*C, KD) forward input rows, dc (E*C, N) output gradient, dw (E*KD, N) fp32
                           KD, N, ROWS_PER_GROUP, N_GROUPS, N_PROGRAMS,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           FLATTEN: tl.constexpr):
    n_tiles_m, n_tiles_n = tl.cdiv(KD, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = n_tiles_m * n_tiles_n
    for tile in tl.range(tl.program_id(0), N_GROUPS * per_group, N_PROGRAMS, flatten=FLATTEN):
        expert = tile // per_group
        pid_m, pid_n = _tile_coords(tile % per_group, n_tiles_m, n_tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        first_row = expert * ROWS_PER_GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r in range(0, ROWS_PER_GROUP, BLOCK_K):      # the reduction runs over the expert's rows
            acc = tl.dot(a_desc.load([first_row + r, off_m]).T, dc_desc.load([first_row + r, off_n]), acc)
        rows = (expert * KD + off_m + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = off_n + tl.arange(0, BLOCK_N)
        tl.store(dw_ptr + rows[:, None] * N + cols[None, :], acc)

@triton.jit
def tma_gemm_swiglu_kernel(a_desc, b_desc, c_desc, h_desc,   # b (E*K, 2FF): gate columns then up columns; c (E*C, 2FF); h (E*C, FF)
                           M, FF, K, ROWS_PER_GROUP, N_PROGRAMS,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr):
    n_tiles_m, n_tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(FF, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, N_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        b_row = (off_m // ROWS_PER_GROUP) * K
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            gate = tl.dot(a, b_desc.load([b_row + k, off_n]), gate)
            up = tl.dot(a, b_desc.load([b_row + k, FF + off_n]), up)
        c_desc.store([off_m, off_n], gate.to(tl.bfloat16))
        c_desc.store([off_m, FF + off_n], up.to(tl.bfloat16))
        g, u = gate.to(tl.bfloat16).to(tl.float32), up.to(tl.bfloat16).to(tl.float32)   # as the layer's SwiGLU sees them
        h_desc.store([off_m, off_n], (g * tl.sigmoid(g) * u).to(tl.bfloat16))

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, schedule) with schedule tiles | persistent | flat. No warp-specialized
# variant: compiled for sm_90 with Triton 3.6, tl.range(..., warp_specialize=True) left every one of these kernels
# unspecialized (on the tile loop, flattened or not, at 4 and 8 warps), and on the K loop at 4 warps the compiler's
# NVGPUWarpSpecialization pass failed.
PLAIN = [(128, 256, 64, 3, 8, "tiles"), (128, 256, 64, 3, 8, "persistent"), (128, 256, 64, 3, 8, "flat"),
         (256, 128, 64, 3, 8, "flat"), (128, 128, 64, 4, 4, "persistent"), (128, 128, 64, 4, 8, "flat")]
SWIGLU = [(128, 128, 64, 3, 8, "persistent"), (128, 128, 64, 3, 8, "flat"), (128, 64, 64, 4, 4, "flat"), (128, 128, 64, 2, 8, "flat")]
DGRAD = [(128, 256, 64, 3, 8, "persistent"), (128, 256, 64, 3, 8, "flat"), (128, 128, 64, 4, 8, "persistent")]
WGRAD = [(128, 256, 64, 3, 8, "persistent"), (128, 256, 64, 4, 8, "persistent"), (128, 128, 64, 4, 8, "persistent"),
         (128, 128, 64, 4, 4, "persistent")]   # flattened, the 128 x 256 weight-gradient tile needs 278 KB of shared memory
# name: (operand widths) forward gate_up and down; dgrad = input gradient (times the transposed weight);
# wgrad = weight gradient into fp32, summed over each expert's rows
GEMMS = ("gate_up", "down", "gate_up dgrad", "down dgrad", "gate_up wgrad", "down wgrad")

def cfg_name(cfg):
    m, n, k, s, w, sched = cfg
    return f"{m}x{n}x{k} s{s} w{w} {sched}"

def _programs(cfg, tiles): return tiles if cfg[5] == "tiles" else min(NUM_SMS, tiles)

def launch_tma(kernel, cfg, a, b2d, outs, N, K, transposed=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, n, k, s, w, sched = cfg
    M = a.shape[0]
    descs = [TensorDescriptor.from_tensor(a, [m, k]), TensorDescriptor.from_tensor(b2d, [n, k] if transposed else [k, n])]
    descs += [TensorDescriptor.from_tensor(o, [m, n]) for o in outs]
    programs = _programs(cfg, triton.cdiv(M, m) * triton.cdiv(N, n))
    extra = dict(B_TRANSPOSED=True) if transposed else {}
    kernel[(programs,)](*descs, M, N, K, C, programs, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8,
                        FLATTEN="flat" in sched, WARP_SPEC=False, num_stages=s, num_warps=w, **extra)

def launch_weight_grad(cfg, rows, grad, out):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, n, k, s, w, sched = cfg
    G, KD, N = out.shape
    programs = _programs(cfg, G * triton.cdiv(KD, m) * triton.cdiv(N, n))
    tma_weight_grad_kernel[(programs,)](TensorDescriptor.from_tensor(rows, [k, m]), TensorDescriptor.from_tensor(grad, [k, n]),
                                        out, KD, N, C, G, programs, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8,
                                        FLATTEN="flat" in sched, num_stages=s, num_warps=w)

def _rel(got, want): return ((got.double() - want).norm() / want.norm()).item()

def build(which, dev="cuda"):
    """(arms {name: fn}, outputs to poison, check() -> worst relative error against float64, FLOPs, baseline of
    each arm) for one GEMM at the capacity shapes."""
    from rtrainer.moe import grouped_gemm_triton, pointer_weight_grad_triton, grouped_gemm_weight_grad_library
    from rtrainer.kernels import swiglu_forward
    bf = dict(device=dev, dtype=torch.bfloat16)
    starts = torch.arange(E, device=dev, dtype=torch.int32) * C
    ends = starts + C
    width = {"gate_up": (D, 2 * FF), "down": (FF, D)}[which.split()[0]]
    K_in, N_out = width                                   # the forward GEMM: (rows, K_in) @ (K_in, N_out)
    w = (torch.randn(E, K_in, N_out, device=dev) / K_in ** 0.5).to(torch.bfloat16)
    arms, baseline = {}, {}
    if which in ("gate_up", "down"):
        a = torch.randn(E * C, K_in, **bf)
        out = torch.empty(E * C, N_out, **bf)
        arms["cublas"] = lambda: torch.bmm(a.view(E, C, K_in), w, out=out.view(E, C, N_out))
        arms["grouped"] = lambda: grouped_gemm_triton(a, w, starts, ends, out=out)
        for cfg in PLAIN:
            arms[f"tma {cfg_name(cfg)}"] = lambda cfg=cfg: launch_tma(tma_gemm_kernel, cfg, a, w.view(E * K_in, N_out), [out], N_out, K_in)
        outs, h = [out], None
        if which == "gate_up":
            h = torch.empty(E * C, FF, **bf)
            outs.append(h)
            arms["cublas + swiglu"] = lambda: (torch.bmm(a.view(E, C, K_in), w, out=out.view(E, C, N_out)), swiglu_forward(out, out=h))
            for cfg in SWIGLU:
                name = f"tma + swiglu epi {cfg_name(cfg)}"
                arms[name], baseline[name] = (lambda cfg=cfg: launch_tma(tma_gemm_swiglu_kernel, cfg, a, w.view(E * K_in, N_out), [out, h], FF, K_in)), "cublas + swiglu"
        def check(name):
            worst = 0.0
            for e in (0, E - 1):
                r = slice(e * C, e * C + 512)
                want = a[r].double() @ w[e].double()
                worst = max(worst, _rel(out[r], want))
                if "swiglu" in name:
                    g, u = want.chunk(2, dim=-1)
                    worst = max(worst, _rel(h[r], torch.nn.functional.silu(g) * u))
            return worst
        return arms, outs, check, 2 * E * C * K_in * N_out, baseline
    if which.endswith("dgrad"):                           # (rows, N_out) @ W^T -> (rows, K_in)
        g = torch.randn(E * C, N_out, **bf)
        out = torch.empty(E * C, K_in, **bf)
        wt = w.transpose(1, 2)
        arms["cublas"] = lambda: torch.bmm(g.view(E, C, N_out), wt, out=out.view(E, C, K_in))
        arms["grouped"] = lambda: grouped_gemm_triton(g, wt, starts, ends, out=out)
        for cfg in DGRAD:
            arms[f"tma {cfg_name(cfg)}"] = lambda cfg=cfg: launch_tma(tma_gemm_kernel, cfg, g, w.view(E * K_in, N_out), [out], K_in, N_out, transposed=True)
        def check(name):
            return max(_rel(out[e * C:e * C + 512], g[e * C:e * C + 512].double() @ wt[e].double()) for e in (0, E - 1))
        return arms, [out], check, 2 * E * C * K_in * N_out, baseline
    x = torch.randn(E * C, K_in, **bf)                    # wgrad: (K_in, rows) @ (rows, N_out) per expert, fp32 out
    g = torch.randn(E * C, N_out, **bf)
    out = torch.empty(E, K_in, N_out, device=dev, dtype=torch.float32)
    arms["cublas"] = lambda: grouped_gemm_weight_grad_library(x, g, starts, ends, out, capacity=C)
    arms["grouped"] = lambda: pointer_weight_grad_triton(x, g, starts, ends, out)   # the pointer kernel this script measured
    for cfg in WGRAD:
        arms[f"tma {cfg_name(cfg)}"] = lambda cfg=cfg: launch_weight_grad(cfg, x, g, out)
    def check(name):
        return max(_rel(out[e, :256], x[e * C:(e + 1) * C, :256].double().T @ g[e * C:(e + 1) * C].double()) for e in (0, E - 1))
    return arms, [out], check, 2 * E * C * K_in * N_out, baseline

def one_line(e): return (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]

def main():
    from rtrainer.kernels import median_ms, ratio_interval, alternation
    torch.manual_seed(0)
    rows = []
    chosen = [g for g in os.environ.get("GEMMS", ",".join(GEMMS)).split(",") if g]
    for which in chosen:
        if which not in GEMMS: raise SystemExit(f"moe_gemm_variants: unknown GEMM {which!r}; choose from {GEMMS}")
        arms, outs, check, flops, baseline = build(which)
        ok, failed = {}, {}
        for name, fn in arms.items():
            try:
                for o in outs: o.fill_(float("nan"))
                fn(); torch.cuda.synchronize()
                err = check(name)
                if not err < 1e-2: raise RuntimeError(f"relative error {err:.2e} against float64")
                ok[name] = fn
                print(f"{which:13s} {name:34s} ok, relative error {err:.1e}", flush=True)
            except Exception as e:
                failed[name] = one_line(e)
                print(f"{which:13s} {name:34s} FAILED {failed[name]}", flush=True)
        times = {name: [] for name in ok}
        for r in range(ROUNDS):
            for name in alternation(ok, r): times[name].append(median_ms(ok[name]))
        for name, ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            row = dict(gemm=which, arm=name, ms=ms, tflops=flops / ms / 1e9)
            ref = baseline.get(name, "cublas")
            if name != "cublas" and ref in times:
                row["vs"] = ref
                row["speed"], row["ci95_low"], row["ci95_high"] = ratio_interval([b / t for b, t in zip(times[ref], ts)])
            rows.append(row)
        rows += [dict(gemm=which, arm=name, failed=err) for name, err in failed.items()]
        del arms, outs, check
        torch.cuda.empty_cache()
    print(f"\n{'gemm':13s} {'arm':34s} {'ms':>7s} {'TFLOP/s':>8s}  speed vs (95%)")
    for r in rows:
        if "failed" in r: print(f"{r['gemm']:13s} {r['arm']:34s} failed: {r['failed'][:80]}"); continue
        extra = f"  {r['speed']:.3f} [{r['ci95_low']:.3f}, {r['ci95_high']:.3f}] vs {r['vs']}" if "speed" in r else ""
        print(f"{r['gemm']:13s} {r['arm']:34s} {r['ms']:7.3f} {r['tflops']:8.1f}{extra}")
    result = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, shape=dict(experts=E, rows_per_expert=C, d_model=D, expert_d_ff=FF),
                  rounds=ROUNDS, method="median_ms per arm, arms alternated over rounds, each checked against float64 first",
                  rows=rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_gemm_variants.json"), "w") as f: json.dump(result, f, indent=1)

def compile_check():
    "Compile the TMA variants for sm_90 (no GPU): shared memory, registers, spills, and whether they were warp-specialized."
    from sm90_compile import compile_sm90, ptxas_usage
    def compile_one(kernel, cfg, transposed=False):
        m, n, k, s, w, sched = cfg
        params = list(inspect.signature(kernel.fn).parameters)
        consts = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, FLATTEN="flat" in sched)
        if "WARP_SPEC" in params: consts["WARP_SPEC"] = False
        if "B_TRANSPOSED" in params: consts["B_TRANSPOSED"] = transposed
        descs = {"a_desc": f"tensordesc<bf16[{m},{k}]>", "b_desc": f"tensordesc<bf16[{n},{k}]>" if transposed else f"tensordesc<bf16[{k},{n}]>",
                 "c_desc": f"tensordesc<bf16[{m},{n}]>", "h_desc": f"tensordesc<bf16[{m},{n}]>"}
        if kernel is tma_weight_grad_kernel:
            descs = {"a_desc": f"tensordesc<bf16[{k},{m}]>", "dc_desc": f"tensordesc<bf16[{k},{n}]>", "dw_ptr": "*fp32"}
        hints = [p for p in params if p in ("M", "N", "FF", "K", "KD", "ROWS_PER_GROUP", "dw_ptr")]
        return compile_sm90(kernel, {p: descs.get(p, "i32") for p in params}, consts, hints, warps=w, stages=s)
    print(f"triton {triton.__version__}")
    for kernel, cfgs, transposed in ((tma_gemm_kernel, PLAIN, False), (tma_gemm_swiglu_kernel, SWIGLU, False),
                                     (tma_gemm_kernel, DGRAD, True), (tma_weight_grad_kernel, WGRAD, False)):
        for cfg in cfgs:
            t0 = time.time()
            try:
                c = compile_one(kernel, cfg, transposed)
                ws = "ttg.warp_specialize" in c.asm["ttgir"]
                registers, spilled = ptxas_usage(c.asm["ptx"])
                print(f"{kernel.fn.__name__ + (' (B^T)' if transposed else ''):24s} {cfg_name(cfg):28s} shared {c.metadata.shared} B, "
                      f"{registers} registers, {spilled} B spilled, {'warp-specialized' if ws else 'not warp-specialized'} "
                      f"({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:
                print(f"{kernel.fn.__name__:24s} {cfg_name(cfg):28s} FAILED {one_line(e)}", flush=True)

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif not torch.cuda.is_available(): sys.exit("moe_gemm_variants: needs a CUDA GPU (or --compile)")
    else: main()
