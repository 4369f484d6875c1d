"""A warp-specialized grouped GEMM in Gluon for the MoE layer's capacity-shaped expert GEMMs, and the SwiGLU in its epilogue.

Why: the MoE chapter's 1.15x target needs the SwiGLU inside the expert GEMMs' epilogues (and the gathers inside their
loads), that is GEMMs of our own at cuBLAS speed whose epilogues hide behind the next tile's products. The Triton
GEMMs of `experiments/moe_gemm_variants.py` are 2-10% behind cuBLAS and Triton 3.6 does not warp-specialize them on sm_90;
their SwiGLU epilogue took 0.97x of cuBLAS plus the separate pass. Gluon places the warps by hand, as the attention
chapter's Hopper kernels do (the kernel is rtrainer.moe_hopper's, `03a_moe_hopper`):

  loader (one warp)            TMA copies of an A tile (BLOCK_M rows x BLOCK_K) and a B tile (BLOCK_K x BLOCK_N)
                               into a ring of STAGES shared-memory slots, one mbarrier per slot counting the bytes;
  two consumer warpgroups      each multiplies its BLOCK_M / 2 rows of the slot's A tile by the B tile on the tensor
                               cores (async wgmma, at most one in flight), frees the slot the previous wgmma read, and
                               at the end of a tile writes its (BLOCK_M / 2, BLOCK_N) output through shared memory
                               and a TMA store that overlaps the next tile's loop.

One program per SM walks the tiles of all experts (uniform groups of C rows, the capacity layout), GROUP_M row tiles
sweeping the columns together. With SWIGLU the loader fills each B tile's left half with BLOCK_N / 2 gate columns
and its right half with the matching up columns (two copies from the layer's [gate | up] weight), so a thread holds
each gate next to its up in registers: the epilogue writes `hidden` in the layer's layout and `act = silu(gate) * up`
of the bf16-rounded values, what the separate pass would write.

Arms, at the moe4b capacity shapes (8 experts x 4,096 rows, D 3072, FF 4096, bf16): cuBLAS's `bmm` against each
config of rtrainer.moe_hopper's kernel on the four products it takes in the layer (gate_up K 3072 N 8192, down K 4096
N 3072, and the input gradients through the transposed weights: down's K 3072 N 4096, gate_up's K 8192 N 3072), and
cuBLAS plus rtrainer's `swiglu_forward` against the fused gate_up. Every arm is first launched small in a child process with a
time limit (an mbarrier mistake hangs rather than fails), then checked against float64 on 256 rows of the first and
last expert, then timed, arms alternated over ROUNDS rounds, with a 95% interval on the ratio to cuBLAS.

Gluon has no interpreter, so the math is only checked on a GPU: `python experiments/moe_gluon_gemm.py` (writes
$OUT/moe_gluon_gemm.json when OUT is set); `python experiments/moe_gluon_gemm.py --compile` compiles every config for sm_90
without a GPU (run it under the GPU's Triton, 3.6) and prints registers, spills and shared memory."""
import json, os, re, subprocess, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer.moe_hopper import gluon_grouped_gemm_kernel, hopper_grouped_gemm, CONSUMER_REGS

E, C, D, FF = 8, 4096, 3072, 4096
ROUNDS = 5
SMOKE_TIMEOUT_S = 90
# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M): BLOCK_M rows are split between the two consumer warpgroups
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 5, 8), (128, 256, 64, 3, 16)]
SWIGLU_CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8)]

def _compile_sm90(config, swiglu, trans_b=False, varlen=False):
    "Compile for sm_90 without a GPU: ((registers, spills), shared memory bytes)."
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import compile_gluon_sm90
    block_m, block_n, block_k, stages, group_m = config
    consts = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, GROUP_M=group_m, SWIGLU=swiglu,
                  TRANS_B=trans_b, VARLEN=varlen, REGS=CONSUMER_REGS, num_warps=4)
    out_cols = block_n // 2 if swiglu else block_n
    descs = dict(a_desc=(block_m, block_k), b_desc=(block_n, block_k) if trans_b else (block_k, out_cols),
                 c_desc=(block_m // 2, out_cols), act_desc=(block_m // 2, block_n // 2))
    types = dict(starts_ptr="*i32", ends_ptr="*i32")
    usage, shared, _ = compile_gluon_sm90(gluon_grouped_gemm_kernel, consts, descs, warps=4, types=types,
                                          hints=["K", "N", "rows_per_expert", "starts_ptr", "ends_ptr"])   # as at the moe4b shapes
    return usage, shared

def compile_check():
    for swiglu, trans_b, configs in ((False, False, CONFIGS), (True, False, SWIGLU_CONFIGS), (False, True, CONFIGS)):
        for config, varlen in [(c, False) for c in configs] + [(configs[0], True)]:
            what = f"swiglu={swiglu} trans_b={trans_b} varlen={varlen} {config}"
            try: (regs, spills), smem = _compile_sm90(config, swiglu, trans_b, varlen); print(f"{what}: {regs} registers, spills {spills}, shared {smem} bytes")
            except Exception as exc: print(f"{what}: does not compile: {str(exc).splitlines()[0][:300]}")

def _problem(K, N, rows=C, seed=0, transposed=False):
    "a (E*rows, K) and w (E, K, N) bf16; transposed: w is the transpose of a contiguous (E, N, K), as an input gradient's weight."
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(E * rows, K, device="cuda", generator=g).bfloat16()
    shape = (E, N, K) if transposed else (E, K, N)
    w = (torch.randn(*shape, device="cuda", generator=g) / K ** 0.5).bfloat16()
    return a, (w.transpose(1, 2) if transposed else w)

def _check(a, w, out, act=None, sample=256):
    "Largest relative error (Frobenius) of out (and act) against float64 on `sample` rows of the first and last expert."
    rows = a.shape[0] // w.shape[0]
    errs = []
    for e in (0, w.shape[0] - 1):
        r = slice(e * rows, e * rows + sample)
        want = a[r].double() @ w[e].double()
        errs.append(((out[r].double() - want).norm() / want.norm()).item())
        if act is not None:
            gate, up = out[r].double().chunk(2, dim=1)                      # the written bf16 values
            act_want = torch.nn.functional.silu(gate) * up
            errs.append(((act[r].double() - act_want).norm() / act_want.norm()).item())
    return max(errs)

def smoke():
    "Small launches of every config (run in a child process with a time limit by the GPU main); kinds 0 plain, 1 swiglu, 2 transposed."
    for kind, configs in ((0, CONFIGS), (1, SWIGLU_CONFIGS), (2, CONFIGS)):
        for i, config in enumerate(configs):
            print(f"SMOKE {kind} {i} started", flush=True)
            a, w = _problem(256, 512, rows=256, transposed=kind == 2)
            out, act = hopper_grouped_gemm(a, w, config, swiglu=kind == 1)
            torch.cuda.synchronize()
            print(f"SMOKE {kind} {i} ok {_check(a, w, out, act):.2e}", flush=True)

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
    alive = {(int(s), int(i)) for s, i in re.findall(r"SMOKE (\d) (\d+) ok", out)}   # (0 plain, 1 swiglu, 2 transposed, config)
    payload["smoke"] = dict(alive=sorted(alive), note=note, out=out[-2000:])
    print("smoke:", sorted(alive), note, out[-800:], flush=True)
    for name, K, N, transposed in (("gate_up", D, 2 * FF, False), ("down", FF, D, False), ("down dgrad", D, FF, True),
                                   ("gate_up dgrad", 2 * FF, D, True)):
        a, w = _problem(K, N, transposed=transposed)
        flops = 2 * E * C * K * N
        arms = {"cublas bmm": lambda: torch.bmm(a.view(E, C, K), w)}
        for i, config in enumerate(CONFIGS):
            if (2 if transposed else 0, i) not in alive: continue
            err = _check(a, w, hopper_grouped_gemm(a, w, config)[0])
            payload["rows"].append(dict(gemm=name, arm=f"gluon {config}", check_rel_error=err))
            print(name, config, "check", f"{err:.2e}", flush=True)
            if err < 1e-2: arms[f"gluon {config}"] = lambda config=config: hopper_grouped_gemm(a, w, config)
        if name == "gate_up":
            arms["cublas bmm + swiglu_forward"] = lambda: swiglu_forward(torch.bmm(a.view(E, C, K), w).view(E * C, N))
            for i, config in enumerate(SWIGLU_CONFIGS):
                if (1, i) not in alive: continue
                out_i, act_i = hopper_grouped_gemm(a, w, config, swiglu=True)
                err = _check(a, w, out_i, act_i)
                payload["rows"].append(dict(gemm=name, arm=f"gluon + swiglu {config}", check_rel_error=err))
                print(name, "swiglu", config, "check", f"{err:.2e}", flush=True)
                if err < 1e-2: arms[f"gluon + swiglu {config}"] = lambda config=config: hopper_grouped_gemm(a, w, config, swiglu=True)
        for fn in arms.values(): fn()
        times = {arm: [] for arm in arms}
        for r in range(ROUNDS):
            for arm in alternation(arms, r): times[arm].append(median_ms(arms[arm]))
        for arm, ts in times.items():
            base = times["cublas bmm + swiglu_forward" if "swiglu" in arm else "cublas bmm"]
            mean, low, high = ratio_interval([b / t for b, t in zip(base, ts)])
            ms = sum(ts) / len(ts)
            payload["rows"].append(dict(gemm=name, arm=arm, ms=ms, tflops=flops / ms / 1e9, speed_vs_cublas=mean, ci95_low=low, ci95_high=high))
    print(f"\n{'gemm':8s} {'arm':52s} {'ms':>7s} {'TFLOP/s':>8s} {'vs cuBLAS':>10s} {'95% interval':>16s}")
    for row in payload["rows"]:
        if "ms" in row:
            ci = f"[{row['ci95_low']:.3f}, {row['ci95_high']:.3f}]" if row["ci95_low"] is not None else ""
            print(f"{row['gemm']:8s} {row['arm']:52s} {row['ms']:7.3f} {row['tflops']:8.1f} {row['speed_vs_cublas']:10.3f} {ci:>16s}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_gluon_gemm.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif "--smoke" in sys.argv: smoke()
    elif not torch.cuda.is_available(): sys.exit("moe_gluon_gemm: needs a CUDA GPU (or --compile)")
    else: gpu_main()
