"""Can a Triton GEMM match cuBLAS on the MoE layer's expert GEMMs, and does a SwiGLU epilogue then pay?

The MoE chapter's profile splits a moe4b layer step into 9.91 ms of expert GEMMs (cuBLAS batched, capacity path) and
1.80 ms of everything else; 1.15x torch.compile needs the SwiGLU inside the GEMM epilogues and the row gathers inside
their loads, which means GEMMs of our own at cuBLAS speed. rtrainer's grouped GEMM (pointer loads, one tile per
program) is 12-15% slower than cuBLAS there. This script times, at the capacity shapes of moe4b (8 experts x 4,096
rows, D 3072, FF 4096, bf16):

  cublas              torch.bmm over (E, C, K) x (E, K, N), what the library capacity path runs
  grouped             rtrainer.moe.grouped_gemm_triton (autotuned, pointer loads)
  tma <cfg>           a Triton GEMM through host-built TMA descriptors: one tile per program (tiles), or a persistent
                      grid of one program per SM walking the tiles (persistent), optionally with the tile loop
                      flattened into the K loop so the pipeline runs across tiles (flat)
and, for the gate_up GEMM, the SwiGLU:
  cublas + swiglu     bmm, then rtrainer's swiglu_forward kernel (what the layer runs)
  tma + swiglu epi    one kernel: gate and up tiles in two accumulators, writes gate_up and silu(gate) * up

Every arm is checked against float64 on 512 rows of the first and last expert before it is timed; arms alternate
over ROUNDS rounds; ratios to cuBLAS carry a 95% interval. A variant that does not compile is listed with its error.
`python tests/moe_gemm_variants.py` on a GPU (writes $OUT/moe_gemm_variants.json when OUT is set);
`python tests/moe_gemm_variants.py --compile` compiles the TMA variants for sm_90 without a GPU (run it under the
GPU's Triton) and prints shared memory and registers."""
import json, os, re, subprocess, sys, tempfile, time, inspect
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
def tma_gemm_kernel(a_desc, b_desc, c_desc,        # a (E*C, K), b (E*K, N) = one (K, N) matrix per expert, c (E*C, N)
                    M, N, K, ROWS_PER_GROUP, N_PROGRAMS,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr):
    n_tiles_m, n_tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_n, N_PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        pid_m, pid_n = _tile_coords(tile, n_tiles_m, n_tiles_n, GROUP_M)
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        b_row = (off_m // ROWS_PER_GROUP) * K            # this tile's expert (a tile never straddles two)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, k]), b_desc.load([b_row + k, off_n]), acc)
        c_desc.store([off_m, off_n], acc.to(tl.bfloat16))

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

def cfg_name(cfg):
    m, n, k, s, w, sched = cfg
    return f"{m}x{n}x{k} s{s} w{w} {sched}"

def launch_tma(kernel, cfg, a, b2d, outs, N, K):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, n, k, s, w, sched = cfg
    M = a.shape[0]
    descs = [TensorDescriptor.from_tensor(a, [m, k]), TensorDescriptor.from_tensor(b2d, [k, n])]
    descs += [TensorDescriptor.from_tensor(o, [m, n]) for o in outs]
    tiles = triton.cdiv(M, m) * triton.cdiv(N, n)
    programs = tiles if sched == "tiles" else min(NUM_SMS, tiles)
    kernel[(programs,)](*descs, M, N, K, C, programs, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8,
                        FLATTEN="flat" in sched, WARP_SPEC="ws" in sched, num_stages=s, num_warps=w)

def arms_for(which, a, w):
    "{name: fn() -> output(s)} for the gate_up or down GEMM of one layer."
    from rtrainer.moe import grouped_gemm_triton
    from rtrainer.kernels import swiglu_forward
    K, N = w.shape[1], w.shape[2]
    M = a.shape[0]
    b2d = w.view(E * K, N)
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    starts = torch.arange(E, device=a.device, dtype=torch.int32) * C
    arms = {"cublas": lambda: torch.bmm(a.view(E, C, K), w, out=out.view(E, C, N)),
            "grouped": lambda: grouped_gemm_triton(a, w, starts, starts + C, out=out)}
    for cfg in PLAIN:
        arms[f"tma {cfg_name(cfg)}"] = lambda cfg=cfg: launch_tma(tma_gemm_kernel, cfg, a, b2d, [out], N, K)
    if which == "gate_up":
        h = torch.empty(M, N // 2, dtype=a.dtype, device=a.device)
        arms["cublas + swiglu"] = lambda: (torch.bmm(a.view(E, C, K), w, out=out.view(E, C, N)), swiglu_forward(out, out=h))
        for cfg in SWIGLU:
            arms[f"tma + swiglu epi {cfg_name(cfg)}"] = lambda cfg=cfg: launch_tma(tma_gemm_swiglu_kernel, cfg, a, b2d, [out, h], N // 2, K)
        return arms, out, h
    return arms, out, None

def check(a, w, out, h, rows=512):
    "Relative error of out (and h) against float64 on `rows` rows of the first and last expert."
    worst = 0.0
    for e in (0, E - 1):
        r = slice(e * C, e * C + rows)
        want = a[r].double() @ w[e].double()
        worst = max(worst, ((out[r].double() - want).norm() / want.norm()).item())
        if h is not None:
            g, u = want.chunk(2, dim=-1)
            want_h = torch.nn.functional.silu(g) * u
            worst = max(worst, ((h[r].double() - want_h).norm() / want_h.norm()).item())
    return worst

def one_line(e): return (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]

def main():
    from rtrainer.kernels import median_ms, ratio_interval, alternation
    torch.manual_seed(0)
    dev = "cuda"
    rows = []
    shapes = {"gate_up": (D, 2 * FF), "down": (FF, D)}
    for which, (K, N) in shapes.items():
        a = torch.randn(E * C, K, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device=dev, dtype=torch.float32) / K ** 0.5).to(torch.bfloat16)
        arms, out, h = arms_for(which, a, w)
        ok, failed = {}, {}
        for name, fn in arms.items():
            try:
                out.fill_(float("nan"))
                if h is not None: h.fill_(float("nan"))
                fn(); torch.cuda.synchronize()
                err = check(a, w, out, h if ("swiglu" in name) else None)
                if not err < 1e-2: raise RuntimeError(f"relative error {err:.2e} against float64")
                ok[name] = fn
                print(f"{which:7s} {name:34s} ok, relative error {err:.1e}", flush=True)
            except Exception as e:
                failed[name] = one_line(e)
                print(f"{which:7s} {name:34s} FAILED {failed[name]}", flush=True)
        times = {name: [] for name in ok}
        for r in range(ROUNDS):
            for name in alternation(ok, r): times[name].append(median_ms(ok[name]))
        flops = 2 * E * C * K * N
        base = times.get("cublas")
        for name, ts in times.items():
            ms = sorted(ts)[len(ts) // 2]
            row = dict(gemm=which, arm=name, ms=ms, tflops=flops / ms / 1e9)
            if base and name != "cublas":
                ref = times["cublas + swiglu"] if ("swiglu" in name and name != "cublas + swiglu") else base
                row["vs"] = "cublas + swiglu" if ref is not base else "cublas"
                row["speed"], row["ci95_low"], row["ci95_high"] = ratio_interval([b / t for b, t in zip(ref, ts)])
            rows.append(row)
        rows += [dict(gemm=which, arm=name, failed=err) for name, err in failed.items()]
        del a, w, out, h
        torch.cuda.empty_cache()
    print(f"\n{'gemm':7s} {'arm':34s} {'ms':>7s} {'TFLOP/s':>8s}  speed vs (95%)")
    for r in rows:
        if "failed" in r: print(f"{r['gemm']:7s} {r['arm']:34s} failed: {r['failed'][:80]}"); continue
        extra = f"  {r['speed']:.3f} [{r['ci95_low']:.3f}, {r['ci95_high']:.3f}] vs {r['vs']}" if "speed" in r else ""
        print(f"{r['gemm']:7s} {r['arm']:34s} {r['ms']:7.3f} {r['tflops']:8.1f}{extra}")
    result = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, shape=dict(experts=E, rows_per_expert=C, d_model=D, expert_d_ff=FF),
                  rounds=ROUNDS, method="median_ms per arm, arms alternated over rounds, each checked against float64 first",
                  rows=rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_gemm_variants.json"), "w") as f: json.dump(result, f, indent=1)

def compile_check():
    "Compile the TMA variants for sm_90 (no GPU): shared memory, registers, spills, and whether they were warp-specialized."
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    def compile_one(kernel, cfg, n_out):
        m, n, k, s, w, sched = cfg
        consts = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, FLATTEN="flat" in sched, WARP_SPEC="ws" in sched)
        params = list(inspect.signature(kernel.fn).parameters)
        descs = {"a_desc": f"tensordesc<bf16[{m},{k}]>", "b_desc": f"tensordesc<bf16[{k},{n}]>",
                 "c_desc": f"tensordesc<bf16[{m},{n}]>", "h_desc": f"tensordesc<bf16[{m},{n}]>"}
        sig = {p: "constexpr" if p in consts else descs.get(p, "i32") for p in params}
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params if p in ("M", "N", "FF", "K", "ROWS_PER_GROUP")}
        src = ASTSource(fn=kernel, signature=sig, constexprs={(params.index(c),): v for c, v in consts.items()}, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w, num_stages=s))
    def registers(compiled):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "k.ptx"), "w") as f: f.write(compiled.asm["ptx"])
            out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", os.path.join(tmp, "k.ptx"), "-o", os.path.join(tmp, "k.cubin")],
                                 capture_output=True, text=True).stderr
        regs, spill = re.search(r"Used (\d+) registers", out), re.search(r"(\d+) bytes spill stores", out)
        return f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else '?'} B spilled"
    print(f"triton {triton.__version__}")
    for kernel, cfgs in ((tma_gemm_kernel, PLAIN), (tma_gemm_swiglu_kernel, SWIGLU)):
        for cfg in cfgs:
            t0 = time.time()
            try:
                c = compile_one(kernel, cfg, 1)
                ws = "ttg.warp_specialize" in c.asm["ttgir"]
                print(f"{kernel.fn.__name__:24s} {cfg_name(cfg):28s} shared {c.metadata.shared} B, {registers(c)}, "
                      f"{'warp-specialized' if ws else 'not warp-specialized'} ({time.time() - t0:.1f} s)", flush=True)
            except Exception as e:
                print(f"{kernel.fn.__name__:24s} {cfg_name(cfg):28s} FAILED {one_line(e)}", flush=True)

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif not torch.cuda.is_available(): sys.exit("moe_gemm_variants: needs a CUDA GPU (or --compile)")
    else: main()
