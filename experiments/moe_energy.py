"""Is the moe4b MoE layer step bound by energy? NVML's energy counter, power and SM clock while each arm runs back to
back: the layer step (forward + backward, 16,384 tokens, D 3072, FF 4096, 8 experts, top-2, bf16) for the library
capacity arm, the same with cuBLAS's bmm for every product ("bmm only") and torch.compile of the capacity reference;
then each expert GEMM of the library arm alone at its moe4b shape (03a's Gluon kernel for the four products, cuBLAS's
bmm with fp32 output for the two weight gradients), cuBLAS's bmm for the four products (what compile calls), and one
bandwidth-bound pass (a bf16 add over 1.5 GiB of traffic). Arms alternate over ROUNDS rounds of SECONDS each.
Per arm: ms and joules per call, mean watts and SM MHz, and the fraction of samples in which the driver reported the
software power cap as a clock limiter. The layer arms are also timed as the chapter's benchmark times them
(median_ms: short batches, each behind an idle spin kernel), in the same rounds, so the two regimes pair up. The
last table puts the isolated GEMMs' joules against the layer's: if the step runs at the power limit, its time is
at least (its GEMMs' joules) / (the limit's watts). LAYER_ONLY=1 runs the layer arms only; HOST_ONLY=1 prints each
layer arm's host time to enqueue one step (to rule out a host-bound back-to-back time) and stops.
Run on the GPU: `python experiments/moe_energy.py` (writes $OUT/moe_energy.json when OUT is set)."""
import ctypes, json, os, statistics, sys, threading, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rtrainer.moe as moe
from rtrainer import moe_hopper
from rtrainer.moe import MoeFeedForward, _moe_layer_step, BENCHMARK_ARMS
from rtrainer.kernels import knob_values, alternation, median_ms, sustained_ms, enqueue_ms, ratio_interval

ROUNDS = int(os.environ.get("ROUNDS", 3))
SECONDS = float(os.environ.get("SECONDS", 3.0))
N, D, FF, E, K = 16_384, 3072, 4096, 8, 2
C = N * K // E
LAYER_ARMS = ("torch.compile capacity", "library capacity", "library capacity, bmm only")
POWER_CAP_REASON = 0x4        # nvmlClocksEventReasonSwPowerCap
NVML_CLOCK_SM = 1

class Nvml:
    "The few NVML calls this needs, through ctypes (the driver's libnvidia-ml; no Python package)."
    def __init__(self, index=0):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)), "nvmlDeviceGetHandleByIndex_v2")

    @staticmethod
    def _check(rc, what):
        if rc != 0: raise RuntimeError(f"moe_energy: {what} returned NVML error {rc}")

    def _query(self, fn, ctype, *args):
        v = ctype()
        rc = getattr(self.lib, fn)(self.handle, *args, ctypes.byref(v))
        return v.value if rc == 0 else None

    def energy_mj(self): return self._query("nvmlDeviceGetTotalEnergyConsumption", ctypes.c_ulonglong)
    def power_w(self):
        mw = self._query("nvmlDeviceGetPowerUsage", ctypes.c_uint)
        return None if mw is None else mw / 1e3
    def sm_mhz(self): return self._query("nvmlDeviceGetClockInfo", ctypes.c_uint, NVML_CLOCK_SM)
    def limit_w(self):
        mw = self._query("nvmlDeviceGetEnforcedPowerLimit", ctypes.c_uint)
        return None if mw is None else mw / 1e3
    def reasons(self):
        r = self._query("nvmlDeviceGetCurrentClocksEventReasons", ctypes.c_ulonglong)
        return r if r is not None else self._query("nvmlDeviceGetCurrentClocksThrottleReasons", ctypes.c_ulonglong)

def measure(nvml, fn, seconds):
    "Run fn back to back for about `seconds` (synchronizing every ~100 ms): ms and mJ per call, mean W, MHz, power-capped share."
    samples, stop = [], threading.Event()
    def poll():
        while not stop.is_set():
            samples.append((nvml.power_w(), nvml.sm_mhz(), nvml.reasons()))
            time.sleep(0.01)
    t_end = time.perf_counter() + 0.3
    while time.perf_counter() < t_end: fn(); torch.cuda.synchronize()          # warm: the clocks settle on this arm
    t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    per_sync = max(1, int(0.1 / max(time.perf_counter() - t0, 1e-5)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    thread = threading.Thread(target=poll); thread.start()
    e0 = nvml.energy_mj(); start.record(); n = 0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        for _ in range(per_sync): fn()
        n += per_sync
        torch.cuda.synchronize()
    end.record(); end.synchronize(); e1 = nvml.energy_mj()
    stop.set(); thread.join()
    ms = start.elapsed_time(end) / n
    good = [s for s in samples if s[0] is not None]
    watts = statistics.fmean(s[0] for s in good) if good else float("nan")
    mhz = statistics.fmean(s[1] for s in good if s[1] is not None) if good else float("nan")
    capped = statistics.fmean(bool((s[2] or 0) & POWER_CAP_REASON) for s in good) if good else float("nan")
    mj = (e1 - e0) / n if e0 is not None and e1 is not None else watts * ms   # else from the sampled power
    return dict(ms=ms, mj=mj, watts=watts, sm_mhz=mhz, power_capped=capped, calls=n, counter=e0 is not None)

def layer_steps():
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(N, D, device="cuda", dtype=dt).requires_grad_()
    grad_y = torch.randn(N, D, device="cuda", dtype=dt)
    steps, first = {}, None
    for name in LAYER_ARMS:
        dispatch, impl, knobs = BENCHMARK_ARMS[name]
        layer = MoeFeedForward(D, FF, E, K, dispatch=dispatch, impl=impl, dtype=dt, device="cuda")
        if first is None: first = layer
        else:
            with torch.no_grad():
                for p, p0 in zip(layer.parameters(), first.parameters()): p.copy_(p0)
        module = torch.compile(layer) if name.startswith("torch.compile") else layer
        params = list(layer.parameters())
        def step(module=module, params=params, knobs=knobs):
            with knob_values(moe, knobs): _moe_layer_step(module, x, grad_y, params)
        steps[name] = step
    return steps

def gemm_calls():
    "The library arm's six products at the moe4b capacity shapes, each alone, and cuBLAS's bmm for the first four."
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    rnd = lambda *s, scale=1.0: torch.randn(*s, device="cuda", dtype=dt, generator=g) * scale
    rows, gate_up, down = rnd(E * C, D), rnd(E, D, 2 * FF, scale=0.02), rnd(E, FF, D, scale=0.02)
    act, grad_out, grad_hidden = rnd(E * C, FF), rnd(E * C, D), rnd(E * C, 2 * FF)
    wg_gate_up = torch.empty(E, D, 2 * FF, device="cuda", dtype=torch.float32)
    wg_down = torch.empty(E, FF, D, device="cuda", dtype=torch.float32)
    hg = moe_hopper.hopper_grouped_gemm
    b = lambda t, cols: t.view(E, C, cols)
    return {
        "Gluon gate_up + SwiGLU": lambda: hg(rows, gate_up, swiglu=True),
        "Gluon down": lambda: hg(act, down),
        "Gluon down input grad": lambda: hg(grad_out, down.transpose(1, 2)),
        "Gluon gate_up input grad": lambda: hg(grad_hidden, gate_up.transpose(1, 2)),
        "cuBLAS gate_up weight grad (fp32 out)": lambda: torch.bmm(b(rows, D).transpose(1, 2), b(grad_hidden, 2 * FF), out_dtype=torch.float32, out=wg_gate_up),
        "cuBLAS down weight grad (fp32 out)": lambda: torch.bmm(b(act, FF).transpose(1, 2), b(grad_out, D), out_dtype=torch.float32, out=wg_down),
        "cuBLAS gate_up": lambda: torch.bmm(b(rows, D), gate_up),
        "cuBLAS down": lambda: torch.bmm(b(act, FF), down),
        "cuBLAS down input grad": lambda: torch.bmm(b(grad_out, D), down.transpose(1, 2)),
        "cuBLAS gate_up input grad": lambda: torch.bmm(b(grad_hidden, 2 * FF), gate_up.transpose(1, 2)),
    }

def memory_pass():
    a = torch.randn(256 * 2**20, device="cuda", dtype=torch.bfloat16)   # 0.5 GiB each: read 1 GiB, write 0.5 GiB
    bb, c = torch.randn_like(a), torch.empty_like(a)
    return {"bandwidth pass (bf16 add, 1.5 GiB)": lambda: torch.add(a, bb, out=c)}

def host_only():
    for name, step in layer_steps().items():
        for _ in range(3): step()
        print(f"{name}: host enqueue {enqueue_ms(step, calls=10):.3f} ms per step, back to back "
              f"{sustained_ms(step):.3f} ms per step", flush=True)

def main():
    if os.environ.get("HOST_ONLY") == "1": return host_only()
    nvml = Nvml()
    layer_only = os.environ.get("LAYER_ONLY") == "1"
    arms = {**layer_steps(), **({} if layer_only else {**gemm_calls(), **memory_pass()})}
    for name, fn in arms.items():                       # compile and first calls out of the way
        t0 = time.perf_counter(); fn(); fn(); torch.cuda.synchronize()
        print(f"{name}: first calls {time.perf_counter() - t0:.1f} s", flush=True)
    runs = {name: [] for name in arms}
    for r in range(ROUNDS):
        for name in alternation(arms, r):
            runs[name].append(measure(nvml, arms[name], SECONDS))
            if name in LAYER_ARMS: runs[name][-1]["burst_ms"] = median_ms(arms[name])
        print(f"round {r}: " + ", ".join(f"{runs[n][-1]['ms']:.3f} ms {runs[n][-1]['mj']:.0f} mJ" for n in arms), flush=True)
    rows = []
    for name, rs in runs.items():
        mean = lambda k: statistics.fmean(x[k] for x in rs)
        rows.append(dict(arm=name, ms=mean("ms"), mj=mean("mj"), mj_min=min(x["mj"] for x in rs), mj_max=max(x["mj"] for x in rs),
                         watts=mean("watts"), sm_mhz=mean("sm_mhz"), power_capped=mean("power_capped"),
                         energy_counter=all(x["counter"] for x in rs), runs=rs))
    by = {row["arm"]: row for row in rows}
    regimes = {}                                          # the library arm's speed over compile's, paired by round
    for name in LAYER_ARMS[1:]:
        for regime, key in (("sustained", "ms"), ("burst", "burst_ms")):
            ratio, lo, hi = ratio_interval([c[key] / a[key] for c, a in zip(runs[LAYER_ARMS[0]], runs[name])])
            regimes[f"{name}, {regime}"] = dict(speed_vs_compile=ratio, ci95=[lo, hi], ms=statistics.fmean(x[key] for x in runs[name]),
                                                compile_ms=statistics.fmean(x[key] for x in runs[LAYER_ARMS[0]]))
    limit = nvml.limit_w()
    ours = [n for n in by if n.startswith("Gluon") or "weight grad" in n]
    cublas = [n for n in by if n.startswith("cuBLAS")]
    bound = {}
    for label, names in (("library capacity", ours), ("library capacity, bmm only", cublas), ("torch.compile capacity", cublas)):
        if not names: continue
        gemm_mj = sum(by[n]["mj"] for n in names)
        layer = by[label]
        bound[label] = dict(gemm_mj_alone=gemm_mj, layer_mj=layer["mj"], layer_ms=layer["ms"], layer_watts=layer["watts"],
                            gemm_share_of_layer_mj=gemm_mj / layer["mj"],
                            ms_at_limit_for_gemm_mj=gemm_mj / limit if limit else None)
    print(f"\npower limit {limit} W")
    print(f"{'arm':42s} {'ms':>7s} {'mJ':>7s} {'mJ range':>13s} {'W':>5s} {'MHz':>5s} {'capped':>6s}")
    for row in rows:
        print(f"{row['arm']:42s} {row['ms']:7.3f} {row['mj']:7.1f} {row['mj_min']:6.1f}-{row['mj_max']:<6.1f} {row['watts']:5.0f} "
              f"{row['sm_mhz']:5.0f} {row['power_capped']:6.2f}")
    print(f"\n{'layer':30s} {'ms':>7s} {'mJ':>7s} {'GEMMs alone mJ':>15s} {'share':>6s} {'ms at limit':>11s}")
    for label, v in bound.items():
        at = f"{v['ms_at_limit_for_gemm_mj']:.3f}" if v["ms_at_limit_for_gemm_mj"] else "n/a"
        print(f"{label:30s} {v['layer_ms']:7.3f} {v['layer_mj']:7.1f} {v['gemm_mj_alone']:15.1f} {v['gemm_share_of_layer_mj']:6.3f} {at:>11s}")
    print(f"\n{'layer, regime':42s} {'ms':>7s} {'compile ms':>10s} {'speed vs compile':>24s}")
    for label, v in regimes.items():
        lo, hi = v["ci95"]
        print(f"{label:42s} {v['ms']:7.3f} {v['compile_ms']:10.3f} {v['speed_vs_compile']:.3f} [{lo:.3f}, {hi:.3f}]")
    if os.environ.get("OUT"):
        payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, power_limit_w=limit, regimes=regimes, rounds=ROUNDS, seconds_per_run=SECONDS,
                       shape=dict(tokens=N, d_model=D, expert_d_ff=FF, experts=E, top_k=K, capacity=C),
                       method=__doc__.split("\n\n")[0].replace("\n", " "), rows=rows, bound=bound)
        with open(os.path.join(os.environ["OUT"], "moe_energy.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if not torch.cuda.is_available(): sys.exit("moe_energy: needs a CUDA GPU")
    main()
