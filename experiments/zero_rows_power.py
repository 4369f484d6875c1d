"""Do zero rows make the power-bound expert GEMMs faster? The moe4b gate_up product (8 experts x 4,096 rows, D 3072,
2FF 8192, bf16) on cuBLAS's bmm and on 03a's Gluon GEMM, with every row random and with a fraction of each expert's
rows zero (as a capacity group's empty slots after drops), arms alternated over ROUNDS rounds (median_ms each), then
each arm run for about a second while nvidia-smi samples power and SM clock. Run on the GPU:
`python experiments/zero_rows_power.py` (writes $OUT/zero_rows_power.json when OUT is set)."""
import json, os, subprocess, sys, threading, time
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer import moe_hopper
from rtrainer.kernels import median_ms, alternation, ratio_interval

ROUNDS = int(os.environ.get("ROUNDS", 5))
E, C, D, N2 = 8, 4096, 3072, 8192
ZERO_FRACTIONS = (0.0, 0.25, 0.5)

def sample_power(fn, seconds=1.0):
    "Mean power (W) and SM clock (MHz) read by nvidia-smi while fn runs back to back for about `seconds`."
    readings, stop = [], threading.Event()
    def poll():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split(",")
            if len(out) == 2: readings.append((float(out[0]), float(out[1])))
            time.sleep(0.05)
    t = threading.Thread(target=poll); fn(); torch.cuda.synchronize(); t.start()
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20): fn()
        torch.cuda.synchronize()
    stop.set(); t.join()
    late = readings[len(readings) // 3:] or readings                  # past the ramp
    return sum(r[0] for r in late) / len(late), sum(r[1] for r in late) / len(late)

def main():
    torch.manual_seed(0)
    w = torch.randn(E, D, N2, device="cuda", dtype=torch.bfloat16) / D ** 0.5
    full = torch.randn(E, C, D, device="cuda", dtype=torch.bfloat16)
    arms = {}
    for z in ZERO_FRACTIONS:
        a = full.clone()
        a[:, C - int(z * C):] = 0                                     # the last rows of every group empty, as after drops
        rows = a.view(E * C, D)
        arms[f"bmm, {z:.0%} zero rows"] = lambda a=a: torch.bmm(a, w)
        arms[f"Gluon, {z:.0%} zero rows"] = lambda rows=rows: moe_hopper.hopper_grouped_gemm(rows, w)
    times = {name: [] for name in arms}
    for r in range(ROUNDS):
        for name in alternation(arms, r): times[name].append(median_ms(arms[name]))
    rows_out = []
    for name, ts in times.items():
        base = times[name.split(",")[0] + ", 0% zero rows"]
        ratio, lo, hi = ratio_interval([b / t for b, t in zip(base, ts)])
        watts, mhz = sample_power(arms[name])
        rows_out.append(dict(arm=name, ms=sum(ts) / len(ts), speed_vs_no_zero_rows=ratio, ci95=[lo, hi], watts=watts, sm_mhz=mhz))
    print(f"{'arm':28s} {'ms':>7s} {'vs no zero rows':>24s} {'W':>6s} {'MHz':>6s}")
    for row in rows_out:
        lo, hi = row["ci95"]
        ci = f"{row['speed_vs_no_zero_rows']:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{row['speed_vs_no_zero_rows']:.3f}"
        print(f"{row['arm']:28s} {row['ms']:7.3f} {ci:>24s} {row['watts']:6.0f} {row['sm_mhz']:6.0f}")
    if os.environ.get("OUT"):
        payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                       shape=dict(experts=E, rows_per_expert=C, d_model=D, n=N2), rounds=ROUNDS, rows=rows_out)
        with open(os.path.join(os.environ["OUT"], "zero_rows_power.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if not torch.cuda.is_available(): sys.exit("zero_rows_power: needs a CUDA GPU")
    main()
