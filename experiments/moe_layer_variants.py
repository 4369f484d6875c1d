"""The moe4b MoE layer (forward + backward, bf16, capacity and dropless) under tile configs of 03a's Gluon GEMM,
against torch.compile: how a config measured on the four products alone (experiments/moe_gluon_gemm.py) does where it counts.
CONFIGS are (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, GROUP_M), set as rtrainer.moe_hopper.GEMM_CONFIG for an arm's steps.
VARIANTS=backends times the default config under other weight-gradient backends instead (EXPERT_WEIGHT_GRAD: the TMA
kernel on capacity groups, cuBLAS per expert on dropless ones), to tell the kernel from the group layout. VARIANTS=blas
runs the library GEMMs through cuBLASLt (torch.backends.cuda.preferred_blas_library) against cuBLAS.
Arms alternate over ROUNDS rounds in one process, each the median of many steps (rtrainer.kernels.median_ms), with a
95% interval on the ratio to the first config's capacity arm. Run on the GPU: `python experiments/moe_layer_variants.py`
(writes $OUT/moe_layer_variants.json, or moe_layer_backends.json, when OUT is set)."""
import json, os, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rtrainer.moe as moe
from rtrainer import moe_hopper
from rtrainer.moe import MoeFeedForward, _moe_layer_step
from rtrainer.kernels import knob_values, median_ms, alternation, ratio_interval, peak_bytes

ROUNDS = int(os.environ.get("ROUNDS", 5))
N, D, FF, E, K = 16_384, 3072, 4096, 8, 2
LIBRARY = {"EXPERT_GEMM": "library", "EXPERT_WEIGHT_GRAD": "auto"}
CONFIGS = [(128, 256, 64, 3, 8), (128, 256, 64, 3, 16), (128, 256, 64, 3, 32)]
ARMS = {"torch.compile capacity (default mode)": ("capacity", None, {})}   # name: (dispatch, GEMM config, knobs); None: compile
BLAS = {}   # arm: the BLAS library PyTorch prefers during its steps (VARIANTS=blas only)
if os.environ.get("VARIANTS", "configs") == "backends":
    ARMS.update({"capacity": ("capacity", CONFIGS[0], {}),
                 "capacity, TMA weight gradient": ("capacity", CONFIGS[0], {"EXPERT_WEIGHT_GRAD": "triton"}),
                 "dropless": ("dropless", CONFIGS[0], {}),
                 "dropless, cuBLAS weight gradient per expert": ("dropless", CONFIGS[0], {"EXPERT_WEIGHT_GRAD": "per_expert"}),
                 "dropless, TMA weight gradient 4 stages": ("dropless", CONFIGS[0], {"TMA_WGRAD_LAUNCH": {**moe.TMA_WGRAD_CONFIG, "num_stages": 4}})})
    BASE = "capacity"
elif os.environ.get("VARIANTS") == "blas":   # the library GEMMs (the capacity weight gradients' bmm) through cuBLASLt
    ARMS.update({"capacity": ("capacity", CONFIGS[0], {}), "capacity, cuBLASLt": ("capacity", CONFIGS[0], {}),
                 "dropless": ("dropless", CONFIGS[0], {}), "dropless, cuBLASLt": ("dropless", CONFIGS[0], {})})
    BASE = "capacity"
    BLAS = {name: "cublaslt" if name.endswith("cuBLASLt") else "cublas" for name in ARMS}   # set before each arm's step
else:
    ARMS.update({f"{dispatch} {config}": (dispatch, config, {}) for dispatch in ("capacity", "dropless") for config in CONFIGS})
    BASE = f"capacity {CONFIGS[0]}"

def _grad(p):
    "A parameter's gradient: its fp32 main_grad where the kernels wrote one, else .grad."
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad

def main():
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(N, D, device="cuda", dtype=dt).requires_grad_()
    grad_y = torch.randn(N, D, device="cuda", dtype=dt)
    layers = {name: MoeFeedForward(D, FF, E, K, dispatch=dispatch, impl="torch" if config is None else "triton", dtype=dt, device="cuda")
              for name, (dispatch, config, _) in ARMS.items()}
    first = next(iter(layers.values()))
    with torch.no_grad():
        for layer in layers.values():
            for p, p0 in zip(layer.parameters(), first.parameters()): p.copy_(p0)
    def make_step(name):
        dispatch, config, knobs = ARMS[name]
        layer, params = layers[name], list(layers[name].parameters())
        module = torch.compile(layer) if config is None else layer
        blas = BLAS.get(name)
        def step():
            if blas: torch.backends.cuda.preferred_blas_library(blas)
            with knob_values(moe, {**LIBRARY, **knobs}), knob_values(moe_hopper, {"GEMM_CONFIG": config or moe_hopper.GEMM_CONFIG}):
                _moe_layer_step(module, x, grad_y, params)
        return step
    steps = {name: make_step(name) for name in ARMS}
    peaks, finite, calls = {}, {}, {}
    for name, fn in steps.items():
        before = dict(moe_hopper.CALLS)
        fn(); fn()
        calls[name] = {k: (v - before.get(k, 0)) // 2 for k, v in moe_hopper.CALLS.items() if v != before.get(k, 0)}
        peaks[name] = peak_bytes(fn) / 2**30
        grads = [x.grad] + [g for p in layers[name].parameters() if (g := _grad(p)) is not None]
        finite[name] = len(grads) > 1 and all(bool(torch.isfinite(g).all()) for g in grads)
        print(f"{name}: first steps done, peak {peaks[name]:.2f} GiB, finite {finite[name]}, kernel calls per step {calls[name]}", flush=True)
    times = {name: [] for name in steps}
    for r in range(ROUNDS):
        for name in alternation(steps, r): times[name].append(median_ms(steps[name]))
        print(f"round {r}: " + ", ".join(f"{times[n][-1]:.3f}" for n in steps), flush=True)
    compile_name = next(iter(ARMS))
    rows = []
    for name, ts in times.items():
        mean = sum(ts) / len(ts)
        r_base, lo_b, hi_b = ratio_interval([b / t for b, t in zip(times[BASE], ts)])
        r_comp, lo_c, hi_c = ratio_interval([b / t for b, t in zip(times[compile_name], ts)])
        rows.append(dict(arm=name, ms=mean, ms_min=min(ts), ms_max=max(ts), speed_vs_base=r_base, base_ci95=[lo_b, hi_b],
                         speed_vs_compile=r_comp, compile_ci95=[lo_c, hi_c], peak_step_gib=peaks[name], finite=finite[name],
                         kernel_calls=calls[name]))
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, shape=dict(tokens=N, d_model=D, expert_d_ff=FF, experts=E, top_k=K),
                   rounds=ROUNDS, base=BASE, rows=rows)
    fmt = lambda v, lo, hi: f"{v:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{v:.3f}"
    print(f"\n{'arm':60s} {'ms':>7s} {'min':>7s} {'max':>7s} {'vs base':>22s} {'vs compile':>22s} {'GiB':>5s}")
    for row in rows:
        print(f"{row['arm']:60s} {row['ms']:7.3f} {row['ms_min']:7.3f} {row['ms_max']:7.3f} {fmt(row['speed_vs_base'], *row['base_ci95']):>22s} "
              f"{fmt(row['speed_vs_compile'], *row['compile_ci95']):>22s} {row['peak_step_gib']:5.2f}")
    if os.environ.get("OUT"):
        name = {"backends": "moe_layer_backends.json", "blas": "moe_layer_blas.json"}.get(os.environ.get("VARIANTS"), "moe_layer_variants.json")
        with open(os.path.join(os.environ["OUT"], name), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if not torch.cuda.is_available(): sys.exit("moe_layer_variants: needs a CUDA GPU")
    main()
