"""Does the attention chapter's lead over cuDNN hold back to back? Forward + backward of flash attention through the
package (the Hopper kernels on) against cuDNN's SDPA at the four reference shapes, each arm timed by `median_ms` (batches
behind an idle spin kernel, as attention_hopper_bench.py times them) and by `sustained_ms` (calls queued back to back
for about SECONDS, the rate of a training loop at the power limit) and by replaying a CUDA graph of the step back to
back for as long (no host work between calls, as the trainer's captured step), ROUNDS alternated rounds in one
process, 95% intervals on the paired ratios; and each arm's host time to enqueue one step. Run on the GPU: `python experiments/attention_sustained.py` (writes
$OUT/attention_sustained.json when OUT is set, with a timeline of every timed window; stage `attention-sustained` logs
the SM clock and power beside it in $OUT/gpu_clocks.csv)."""
import json, os, statistics, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rtrainer.attention_hopper as hopper                     # registers the Hopper kernels
from rtrainer.attention import flash_attention, attention_benchmark_inputs, attention_flops, REFERENCE_ATTENTION_SHAPES, _sdpa_attention
from rtrainer.kernels import median_ms, sustained_ms, enqueue_ms, ratio_interval, alternation

ROUNDS = int(os.environ.get("ROUNDS", 3))
SECONDS = float(os.environ.get("SECONDS", 0.5))
TIMELINE = []   # (shape, arm, regime, start, end) in the host's wall-clock seconds: to line up with a clock and power log

def graph_replay(step):
    "A function replaying one captured `step()` (warmed on a side stream first)."
    side = torch.cuda.Stream(); side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3): step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph): step()
    return graph.replay

def main():
    rows = []
    for name, (B, H, KV, T, hd) in REFERENCE_ATTENTION_SHAPES.items():
        q, k, v, do, kr, vr = attention_benchmark_inputs(B, H, KV, T, hd)
        cudnn = _sdpa_attention("CUDNN_ATTENTION", False)
        arms = {"flash": lambda: torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do),
                "cudnn": lambda: torch.autograd.grad(cudnn(q, kr, vr), (q, kr, vr), do)}
        for step in arms.values(): step()
        replays = {a: graph_replay(step) for a, step in arms.items()}
        host = {a: enqueue_ms(step, calls=20) for a, step in arms.items()}
        burst, sustained, graphed = {a: [] for a in arms}, {a: [] for a in arms}, {a: [] for a in arms}
        for r in range(ROUNDS):
            for a in alternation(arms, r):
                t0 = time.time(); burst[a].append(median_ms(arms[a]))
                t1 = time.time(); sustained[a].append(sustained_ms(arms[a], seconds=SECONDS))
                t2 = time.time(); graphed[a].append(sustained_ms(replays[a], seconds=SECONDS))
                TIMELINE.extend([(name, a, "burst", t0, t1), (name, a, "sustained", t1, t2), (name, a, "graph", t2, time.time())])
        flops = 3.5 * attention_flops(B, H, T, hd)
        row = dict(shape=name, B=B, H=H, KV=KV, T=T, hd=hd, hopper_kernels=hopper.ENABLED, host_ms=host)
        for regime, times in (("burst", burst), ("sustained", sustained), ("graph", graphed)):
            ms = {a: statistics.fmean(t) for a, t in times.items()}
            row[regime] = dict(ms=ms, tflops={a: flops / m / 1e9 for a, m in ms.items()},
                               flash_vs_cudnn=ratio_interval([c / f for c, f in zip(times["cudnn"], times["flash"])]))
        rows.append(row)
        print(name, " ".join(f"{g}: {row[g]['flash_vs_cudnn'][0]:.3f} [{row[g]['flash_vs_cudnn'][1]:.3f}, {row[g]['flash_vs_cudnn'][2]:.3f}]"
                             for g in ("burst", "sustained", "graph")), "host ms", {a: round(h, 3) for a, h in host.items()}, flush=True)
    ci = lambda x: "%.3f [%.3f, %.3f]" % x
    print(f"\n{'shape':10s} {'regime':10s} {'flash ms':>9s} {'cudnn ms':>9s} {'flash/cudnn':>24s} {'host ms (flash, cudnn)':>24s}")
    for r in rows:
        for g in ("burst", "sustained", "graph"):
            x = r[g]
            print(f"{r['shape']:10s} {g:10s} {x['ms']['flash']:9.3f} {x['ms']['cudnn']:9.3f} {ci(x['flash_vs_cudnn']):>24s} "
                  f"{r['host_ms']['flash']:11.3f}, {r['host_ms']['cudnn']:.3f}")
    if os.environ.get("OUT"):
        payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, rounds=ROUNDS, seconds_per_sustained_run=SECONDS, rows=rows,
                       method=__doc__.split("\n\n")[0].replace("\n", " "),
                       flop_convention="causal = half of 4*B*H*T^2*hd; forward + backward = 3.5x the forward", timeline=TIMELINE)
        with open(os.path.join(os.environ["OUT"], "attention_sustained.json"), "w") as f: json.dump(payload, f, indent=1)

def clock_summary(folder):
    """Mean SM clock (MHz), power (W) and temperature of every (shape, regime, arm) window of a run, from FOLDER's
    attention_sustained.json (its timeline) and gpu_clocks.csv (nvidia-smi every 50 ms, same host clock); the first
    0.1 s of each window is skipped. Runs on any machine: `python experiments/attention_sustained.py --clocks FOLDER`."""
    from arm_rounds import smi_samples
    run = json.load(open(os.path.join(folder, "attention_sustained.json")))
    samples = smi_samples(os.path.join(folder, "gpu_clocks.csv"))
    windows = {}
    for shape, arm, regime, start, end in run["timeline"]:
        windows.setdefault((shape, regime, arm), []).extend(s for s in samples if start + 0.1 <= s[0] <= end)
    rows = [dict(shape=shape, regime=regime, arm=arm, samples=len(got), sm_clock_mhz=statistics.fmean(s[1] for s in got),
                 power_w=statistics.fmean(s[2] for s in got), temperature_c=statistics.fmean(s[3] for s in got))
            for (shape, regime, arm), got in windows.items() if got]
    for r in rows: print(f"{r['shape']:10s} {r['regime']:10s} {r['arm']:6s} {r['sm_clock_mhz']:6.0f} MHz {r['power_w']:5.0f} W {r['samples']:4d} samples")
    return rows

if __name__ == "__main__":
    if sys.argv[1:2] == ["--clocks"]:
        print(json.dumps(clock_summary(sys.argv[2]), indent=1)); sys.exit()
    if not torch.cuda.is_available(): sys.exit("attention_sustained: needs a CUDA GPU")
    main()
