"""A warp-specialized grouped GEMM in Gluon for the MoE layer's capacity-shaped expert GEMMs, and the SwiGLU in its epilogue.

Why: the MoE chapter's 1.15x target needs the SwiGLU inside the expert GEMMs' epilogues (and the gathers inside their
loads), that is GEMMs of our own at cuBLAS speed whose epilogues hide behind the next tile's products. The Triton
GEMMs of `tests/moe_gemm_variants.py` are 2-10% behind cuBLAS and Triton 3.6 does not warp-specialize them on sm_90;
their SwiGLU epilogue took 0.97x of cuBLAS plus the separate pass. Gluon places the warps by hand, as the attention
chapter's Hopper kernels do:

  loader (one warp)            TMA copies of an A tile (BLOCK_M rows x BLOCK_K) and a B tile (BLOCK_K x BLOCK_N)
                               into a ring of STAGES shared-memory slots, one mbarrier per slot counting the bytes;
  two consumer warpgroups      each multiplies its BLOCK_M / 2 rows of the slot's A tile by the B tile on the tensor
                               cores (async wgmma, at most one in flight), frees the slot the previous wgmma read, and
                               at the end of a tile writes its (BLOCK_M / 2, BLOCK_N) output through shared memory
                               and a TMA store that overlaps the next tile's loop.

One program per SM walks the tiles of all experts (uniform groups of C rows, the capacity layout), GROUP_M row tiles
sweeping the columns together. With SWIGLU the gate_up weight's columns are interleaved (gate j at column 2j, up j
at 2j + 1), so each accumulator row holds (gate, up) pairs in adjacent registers: the epilogue writes `hidden` (in
that interleaved order) and `act = silu(gate) * up` of the bf16-rounded pair, the values the separate pass would read.

Arms, at the moe4b capacity shapes (8 experts x 4,096 rows, D 3072, FF 4096, bf16): cuBLAS's `bmm` (what the layer
runs) against each Gluon config on the gate_up (K 3072, N 8192) and down (K 4096, N 3072) products, and cuBLAS plus
rtrainer's `swiglu_forward` against the fused gate_up. Every arm is first launched small in a child process with a
time limit (an mbarrier mistake hangs rather than fails), then checked against float64 on 256 rows of the first and
last expert, then timed, arms alternated over ROUNDS rounds, with a 95% interval on the ratio to cuBLAS.

Gluon has no interpreter, so the math is only checked on a GPU: `python tests/moe_gluon_gemm.py` (writes
$OUT/moe_gluon_gemm.json when OUT is set); `python tests/moe_gluon_gemm.py --compile` compiles every config for sm_90
without a GPU (run it under the GPU's Triton, 3.6) and prints registers, spills and shared memory."""
import json, os, re, subprocess, sys, time
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

E, C, D, FF = 8, 4096, 3072, 4096
ROUNDS = 5
SMOKE_TIMEOUT_S = 90
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M): BLOCK_M rows are split between the two consumer warpgroups
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 5, 8), (128, 256, 64, 3, 16)]
SWIGLU_CONFIGS = [(128, 128, 64, 4, 8), (128, 256, 64, 2, 8)]
LOADER_REGS = gl.constexpr(24)
CONSUMER_REGS = 232

@gluon.jit
def _tile(t, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    "(expert, row tile, column tile) of tile t: experts one after another, GROUP_M row tiles sweeping the columns."
    per_expert = tiles_m * tiles_n
    e = t // per_expert
    r = t % per_expert
    width = GROUP_M * tiles_n
    first_m = (r // width) * GROUP_M
    size_m = gl.minimum(tiles_m - first_m, GROUP_M)
    return e, first_m + (r % width) % size_m, (r % width) // size_m

@gluon.jit
def _loader(a_desc, b_desc, a_smem, b_smem, ready, free, n_tiles, tiles_m, tiles_n, K, rows_per_expert,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, m, n = _tile(t, tiles_m, tiles_n, GROUP_M)
        for k in range(0, K, BLOCK_K):
            slot = it % STAGES
            mbarrier.wait(free.index(slot), ((it // STAGES) & 1) ^ 1)      # a fresh barrier passes phase 1 at once
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [e * rows_per_expert + m * BLOCK_M, k], ready.index(slot), a_smem.index(slot))
            tma.async_copy_global_to_shared(b_desc, [e * K + k, n * BLOCK_N], ready.index(slot), b_smem.index(slot))
            it += 1

@gluon.jit
def _consumer(a_smem, b_smem, c_smem, act_smem, c_desc, act_desc, ready, free, n_tiles, tiles_m, tiles_n, K, rows_per_expert,
              CONS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
              GROUP_M: gl.constexpr, SWIGLU: gl.constexpr):
    HALF: gl.constexpr = BLOCK_M // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    it = 0
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        e, m, n = _tile(t, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        for k in range(0, K, BLOCK_K):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            acc = warpgroup_mma(a_smem.index(slot).slice(CONS * HALF, HALF), b_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])           # the previous step's wgmma is done
            mbarrier.arrive(free.index((it + STAGES - 1) % STAGES), count=1, pred=k > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(free.index((it + STAGES - 1) % STAGES), count=1)
        row = e * rows_per_expert + m * BLOCK_M + CONS * HALF
        hidden = acc.to(gl.bfloat16)
        tma.store_wait(0)                                                     # the last tile's output has left
        c_smem.store(hidden)
        if SWIGLU:                                                            # (gate, up) pairs in adjacent columns
            gate, up = gl.split(hidden.to(gl.float32).reshape([HALF, BLOCK_N // 2, 2]))
            act_smem.store((gate / (1.0 + gl.exp(-gate)) * up).to(gl.bfloat16))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row, n * BLOCK_N], c_smem)
        if SWIGLU:
            tma.async_copy_shared_to_global(act_desc, [row, n * (BLOCK_N // 2)], act_smem)
    tma.store_wait(0)

@gluon.jit
def gluon_grouped_gemm_kernel(a_desc, b_desc, c_desc, act_desc, n_tiles, tiles_m, tiles_n, K, rows_per_expert,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                              GROUP_M: gl.constexpr, SWIGLU: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    "out[e*C + r] = a[e*C + r] @ w[e] for uniform groups of C rows, persistent: a loader warp and two consumer warpgroups."
    HALF: gl.constexpr = BLOCK_M // 2
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, HALF, BLOCK_N], c_desc.layout)
    if SWIGLU:
        act_smem = gl.allocate_shared_memory(act_desc.dtype, [2, HALF, BLOCK_N // 2], act_desc.layout)
    else:
        act_smem = c_smem                                                     # not written
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)                                 # both consumers are done with the slot
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, c_smem.index(0), act_smem.index(0), c_desc, act_desc, ready, free, n_tiles, tiles_m,
                     tiles_n, K, rows_per_expert, 0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SWIGLU)),
        (_consumer, (a_smem, b_smem, c_smem.index(1), act_smem.index(1), c_desc, act_desc, ready, free, n_tiles, tiles_m,
                     tiles_n, K, rows_per_expert, 1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M, SWIGLU)),
        (_loader, (a_desc, b_desc, a_smem, b_smem, ready, free, n_tiles, tiles_m, tiles_n, K, rows_per_expert,
                   BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M)),
    ], [4, 1], [REGS, LOADER_REGS])

def _layout(block_shape): return gl.NVMMASharedLayout.get_default_for(block_shape, gl.bfloat16)

def _desc(t, block_shape): return TensorDescriptor(t, list(t.shape), list(t.stride()), block_shape, _layout(block_shape))

def gluon_grouped_gemm(a, w, config, swiglu=False):
    """(out (E*C, N), act (E*C, N/2) or None) for a (E*C, K) and w (E, K, N) bf16; with swiglu, w's columns are
    (gate, up) pairs and act = silu(gate) * up of each pair."""
    block_m, block_n, block_k, stages, group_m = config
    (R, K), (n_experts, _, N) = a.shape, w.shape
    rows = R // n_experts
    if rows % block_m or N % block_n or K % block_k: raise ValueError(f"gluon_grouped_gemm: {R // n_experts} x {N} x {K} is off the {config} tile")
    out = torch.empty(R, N, dtype=a.dtype, device=a.device)
    act = torch.empty(R, N // 2, dtype=a.dtype, device=a.device) if swiglu else out[:, : N // 2]   # not written without swiglu
    tiles_m, tiles_n = rows // block_m, N // block_n
    n_tiles = n_experts * tiles_m * tiles_n
    programs = min(n_tiles, torch.cuda.get_device_properties(a.device).multi_processor_count)
    act_desc = _desc(act, [block_m // 2, block_n // 2]) if swiglu else TensorDescriptor(out, [R, N], [N, 1], [block_m // 2, block_n // 2], _layout([block_m // 2, block_n // 2]))
    gluon_grouped_gemm_kernel[(programs,)](
        _desc(a, [block_m, block_k]), _desc(w.view(n_experts * K, N), [block_k, block_n]), _desc(out, [block_m // 2, block_n]), act_desc,
        n_tiles, tiles_m, tiles_n, K, rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m,
        SWIGLU=swiglu, REGS=CONSUMER_REGS, num_warps=4)
    return out, (act if swiglu else None)

def interleave_gate_up(w):
    "w (E, K, 2FF) as [gate | up] -> (gate, up) pairs: gate j at column 2j, up j at 2j + 1."
    n_experts, K, two_ff = w.shape
    return torch.stack(w.split(two_ff // 2, dim=-1), dim=-1).reshape(n_experts, K, two_ff).contiguous()

def _compile_sm90(config, swiglu):
    "Compile for sm_90 without a GPU: (registers / spills, shared memory bytes)."
    import inspect
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import ptxas_usage
    block_m, block_n, block_k, stages, group_m = config
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m, SWIGLU=swiglu,
                  REGS=CONSUMER_REGS, num_warps=4)
    blocks = dict(a_desc=[block_m, block_k], b_desc=[block_k, block_n], c_desc=[block_m // 2, block_n], act_desc=[block_m // 2, block_n // 2])
    kernel = gluon_grouped_gemm_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else f"tensordesc<bf16[{blocks[p][0]}, {blocks[p][1]}],{_layout(blocks[p])!r}>" if p in blocks else "i32"
           for p in params}
    src = GluonASTSource(kernel, sig, constexprs={(params.index(n),): c for n, c in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))
    return ptxas_usage(c.asm["ptx"]), c.metadata.shared

def compile_check():
    for swiglu, configs in ((False, CONFIGS), (True, SWIGLU_CONFIGS)):
        for config in configs:
            try: (regs, spills), smem = _compile_sm90(config, swiglu); print(f"swiglu={swiglu} {config}: {regs} registers, spills {spills}, shared {smem} bytes")
            except Exception as exc: print(f"swiglu={swiglu} {config}: does not compile: {str(exc).splitlines()[0][:300]}")

def _problem(K, N, rows=C, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(E * rows, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, K, N, device="cuda", generator=g) / K ** 0.5).bfloat16()
    return a, w

def _check(a, w, out, act=None, sample=256):
    "Largest relative error (Frobenius) of out (and act) against float64 on `sample` rows of the first and last expert."
    rows = a.shape[0] // w.shape[0]
    errs = []
    for e in (0, w.shape[0] - 1):
        r = slice(e * rows, e * rows + sample)
        want = a[r].double() @ w[e].double()
        errs.append(((out[r].double() - want).norm() / want.norm()).item())
        if act is not None:
            h = out[r].double().view(sample, -1, 2)                         # the written bf16 pairs
            act_want = torch.nn.functional.silu(h[..., 0]) * h[..., 1]
            errs.append(((act[r].double() - act_want).norm() / act_want.norm()).item())
    return max(errs)

def smoke():
    "Small launches of every config (run in a child process with a time limit by the GPU main)."
    for swiglu, configs in ((False, CONFIGS), (True, SWIGLU_CONFIGS)):
        for i, config in enumerate(configs):
            print(f"SMOKE {int(swiglu)} {i} started", flush=True)
            a, w = _problem(256, 512, rows=256)
            out, act = gluon_grouped_gemm(a, w, config, swiglu)
            torch.cuda.synchronize()
            print(f"SMOKE {int(swiglu)} {i} ok {_check(a, w, out, act):.2e}", flush=True)

def gpu_main():
    from rtrainer.kernels import median_ms, ratio_interval, alternation
    from rtrainer.kernels import swiglu_forward
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   shapes=dict(E=E, C=C, D=D, FF=FF), rounds=ROUNDS, configs=CONFIGS, swiglu_configs=SWIGLU_CONFIGS, smoke=None, rows=[])
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke"], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
        out, note = r.stdout, "" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-600:]}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        note = f"hung: stopped after {SMOKE_TIMEOUT_S} s"
    alive = {(int(s), int(i)) for s, i in re.findall(r"SMOKE (\d) (\d+) ok", out)}
    payload["smoke"] = dict(alive=sorted(alive), note=note, out=out[-2000:])
    print("smoke:", sorted(alive), note, out[-800:], flush=True)
    for name, K, N in (("gate_up", D, 2 * FF), ("down", FF, D)):
        a, w = _problem(K, N)
        flops = 2 * E * C * K * N
        arms = {"cublas bmm": lambda: torch.bmm(a.view(E, C, K), w)}
        for i, config in enumerate(CONFIGS):
            if (0, i) not in alive: continue
            err = _check(a, w, gluon_grouped_gemm(a, w, config)[0])
            payload["rows"].append(dict(gemm=name, arm=f"gluon {config}", check_rel_error=err))
            print(name, config, "check", f"{err:.2e}", flush=True)
            if err < 1e-2: arms[f"gluon {config}"] = lambda config=config: gluon_grouped_gemm(a, w, config)
        if name == "gate_up":
            wi = interleave_gate_up(w)
            arms["cublas bmm + swiglu_forward"] = lambda: swiglu_forward(torch.bmm(a.view(E, C, K), w).view(E * C, N))
            for i, config in enumerate(SWIGLU_CONFIGS):
                if (1, i) not in alive: continue
                out_i, act_i = gluon_grouped_gemm(a, wi, config, swiglu=True)
                err = _check(a, wi, out_i, act_i)
                payload["rows"].append(dict(gemm=name, arm=f"gluon + swiglu {config}", check_rel_error=err))
                print(name, "swiglu", config, "check", f"{err:.2e}", flush=True)
                if err < 1e-2: arms[f"gluon + swiglu {config}"] = lambda config=config: gluon_grouped_gemm(a, wi, config, swiglu=True)
        for fn in arms.values(): fn()
        times = {arm: [] for arm in arms}
        for r in range(ROUNDS):
            for arm in alternation(arms, r): times[arm].append(median_ms(arms[arm]))
        for arm, ts in times.items():
            base = times["cublas bmm + swiglu_forward" if "swiglu" in arm else "cublas bmm"]
            mean, low, high = ratio_interval([b / t for b, t in zip(base, ts)])
            ms = sum(ts) / len(ts)
            payload["rows"].append(dict(gemm=name, arm=arm, ms=ms, tflops=flops / ms / 1e9, speed_vs_cublas=mean, ci95_low=low, ci95_high=high))
    print(f"\n{'gemm':8s} {'arm':40s} {'ms':>7s} {'TFLOP/s':>8s} {'vs cuBLAS':>10s} {'95% interval':>16s}")
    for row in payload["rows"]:
        if "ms" in row:
            ci = f"[{row['ci95_low']:.3f}, {row['ci95_high']:.3f}]" if row["ci95_low"] is not None else ""
            print(f"{row['gemm']:8s} {row['arm']:40s} {row['ms']:7.3f} {row['tflops']:8.1f} {row['speed_vs_cublas']:10.3f} {ci:>16s}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_gluon_gemm.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif "--smoke" in sys.argv: smoke()
    elif not torch.cuda.is_available(): sys.exit("moe_gluon_gemm: needs a CUDA GPU (or --compile)")
    else: gpu_main()
