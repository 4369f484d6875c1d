"""Where the time of 03a's SwiGLU backward in down's input gradient goes: the kernel with parts of its epilogue
warpgroup taken out, timed against the plain product at the same tile config (128 x 128, 5 stages) at the moe4b
capacity shape. The parts are swapped by replacing the Gluon functions the kernel calls (each swap compiles its own
kernel): `rows` no math (the epilogue warpgroup still loads the gates and ups by TMA and stores the tile's three
outputs), `handoff` only the barriers (the consumers still write d act to shared memory and wait for the epilogue
warpgroup, which does nothing else). Each arm also runs back to back for two seconds while nvidia-smi samples the SM
clock and the board's power. The outputs of the stripped kernels are not checked (they are wrong by design).
Run on the GPU: `python tests/moe_swiglu_backward_probe.py` ($OUT/moe_swiglu_backward_probe.json when OUT is set)."""
import json, os, sys, time, types
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer import moe_hopper
import rtrainer.moe as moe
from rtrainer.kernels import median_ms, alternation, ratio_interval
from moe_gluon_gemm import _problem, _routing, E, C, D, FF

@gluon.jit
def _no_rows(d_smem, gate_smem, up_smem, assignment_ptr, weight_ptr, dweight_ptr, row, BLOCK_N: gl.constexpr):
    pass

@gluon.jit
def _handoff_only(c_smem, c_desc, h_desc, gu_smem, gu_ready, acc_ready, acc_free, assignment_ptr, weight_ptr,
                  dweight_ptr, n_tiles, tiles_m, tiles_n, N, rows_per_expert, starts_ptr, ends_ptr, n_groups,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, VARLEN: gl.constexpr):
    i = 0
    n_tiles = moe_hopper._tile_count(n_tiles, tiles_n, starts_ptr, ends_ptr, n_groups, BLOCK_M, VARLEN)
    for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        for c in gl.static_range(2):
            mbarrier.wait(acc_ready.index(c), i & 1)
            mbarrier.arrive(acc_free.index(c), count=1)
        i += 1

def _clocks_and_power(fn, seconds=2.0):
    "(mean SM clock MHz, mean board power W) that nvidia-smi samples every 50 ms while fn runs back to back."
    import subprocess
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20): fn()
        torch.cuda.synchronize()
    smi.terminate()
    samples = [tuple(float(v) for v in line.split(",")) for line in smi.communicate()[0].splitlines()[2:] if line.count(",") == 1]
    return tuple(sum(v) / len(v) for v in zip(*samples)) if samples else (float("nan"), float("nan"))

def _rebuild(jit_fn, **names):
    "A new Gluon function from jit_fn's code with some of the names it calls bound to other functions."
    fn = jit_fn.fn
    new = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__annotations__, new.__doc__, new.__qualname__, new.__module__ = fn.__annotations__, fn.__doc__, fn.__qualname__, fn.__module__
    return gluon.jit(new)

def main():
    a, w = _problem(D, FF, transposed=True)
    hidden = torch.randn(E * C, 2 * FF, device="cuda").bfloat16()
    row_assignment, weights = _routing(E * C)
    config = moe_hopper.SWIGLU_BACKWARD_CONFIG
    d_sep = moe_hopper.hopper_grouped_gemm(a, w, moe_hopper.GEMM_CONFIG)[0]
    fused = lambda: moe_hopper.hopper_swiglu_backward(a, w, hidden, row_assignment, weights, config)
    arms = {"plain product, same config": lambda: moe_hopper.hopper_grouped_gemm(a, w, config),
            "plain product, (128, 256, 64, 3, 8)": lambda: moe_hopper.hopper_grouped_gemm(a, w, moe_hopper.GEMM_CONFIG),
            "swiglu backward in the kernel": fused}
    def with_kernel(kernel):
        def run():
            original = moe_hopper.gluon_grouped_gemm_kernel
            moe_hopper.gluon_grouped_gemm_kernel = kernel                   # _launch looks it up on each call
            try: return fused()
            finally: moe_hopper.gluon_grouped_gemm_kernel = original
        return run
    no_rows = _rebuild(moe_hopper._swiglu_backward_epilogue, _swiglu_backward_rows=_no_rows)
    arms["no math (TMA in and out, barriers)"] = with_kernel(_rebuild(moe_hopper.gluon_grouped_gemm_kernel, _swiglu_backward_epilogue=no_rows))
    arms["handoff only (barriers)"] = with_kernel(_rebuild(moe_hopper.gluon_grouped_gemm_kernel, _swiglu_backward_epilogue=_handoff_only))
    arms["routed_swiglu_backward alone"] = lambda: moe.routed_swiglu_backward(d_sep, hidden, row_assignment, weights)
    for name, fn in arms.items(): fn(); torch.cuda.synchronize(); print("ran", name, flush=True)
    power = {name: _clocks_and_power(fn) for name, fn in arms.items()}
    for name, (clock, watts) in power.items(): print(f"{name:45s} SM clock {clock:6.0f} MHz, {watts:5.0f} W", flush=True)
    times = {n: [] for n in arms}
    for r in range(5):
        for n in alternation(arms, r): times[n].append(median_ms(arms[n]))
    base = "plain product, same config"
    rows = []
    for n, ts in times.items():
        mean, lo, hi = ratio_interval([b / t for b, t in zip(times[base], ts)])
        rows.append(dict(arm=n, ms=sum(ts) / len(ts), ms_min=min(ts), ms_max=max(ts), speed_vs_plain=mean, ci95=[lo, hi],
                         sm_clock_mhz=power[n][0], power_w=power[n][1]))
        print(f"{n:45s} {sum(ts) / len(ts):7.3f} ms  {mean:6.3f} [{lo}, {hi}]", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_swiglu_backward_probe.json"), "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, config=config, rows=rows), f, indent=1)

if __name__ == "__main__":
    if not torch.cuda.is_available(): sys.exit("moe_swiglu_backward_probe: needs a CUDA GPU")
    main()
