"""The default trainer's step (one CUDA graph, replayed) taken apart on the device: its kernels by roofline family, the
device's idle time between them, and the step against its floor. `rtrainer profile` takes the eager step apart, whose
phases it synchronizes and whose launch gaps are partly the profiler's; this is the step that `versus` times.
The question, the runs and the answer: experiments/graph_step_profile.md.

Per configuration, in a fresh process: the trainer with cuda_graph="on", its warm-up and capture (arm_rounds.warmup_steps),
STEPS replayed steps timed with CUDA events, then one replayed step after a second's rest under torch.profiler (CUDA
activity only), then STEPS more back to back under it; nvidia-smi samples the SM clock and the power. The kernels of the
one step are sorted into families as the roofline does (`kernel_family`); the idle time is the sum of the gaps between
them (`device_gaps`); the floors are `roofline_report`'s at the ceilings the process measures after the step's memory is
freed (`measure_ceilings`).

`python experiments/graph_step_profile.py [--configs rb100m,prof183m] [--steps 10]` on a GPU (GPU suite stage
graph-profile); writes $OUT/graph_step_profile.json when OUT is set and prints a short table last."""
import argparse, gc, json, os, subprocess, sys, tempfile, time
import torch

RESULT = "PROFILE_RESULT "

def sm_clocks(path, windows):
    "{window: (mean SM MHz, mean W, samples)} of nvidia-smi's samples inside each (start, end) wall-clock window."
    from arm_rounds import smi_samples
    samples, out = smi_samples(path), {}
    for name, (t0, t1) in windows.items():
        inside = [(mhz, w) for t, mhz, w in samples if t0 <= t <= t1]
        out[name] = (sum(m for m, _ in inside) / len(inside), sum(w for _, w in inside) / len(inside), len(inside)) if inside else None
    return out

def child(spec):
    from torch.profiler import ProfilerActivity, profile as torch_profile
    from arm_rounds import synthetic_trainer, warmup_steps
    from rtrainer.profiling import _kineto_lists, attribute_device_events, device_gaps, measure_ceilings, roofline_report
    from rtrainer.model import model_config
    smi_log = os.path.join(spec["out_dir"], "clocks.csv")   # the SM clock and the power, every 100 ms, through the run
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=open(smi_log, "w"), stderr=subprocess.DEVNULL)
    windows = {}
    trainer = synthetic_trainer(spec, cuda_graph="on")
    device = trainer.device
    sync = lambda: torch.cuda.synchronize(device)
    losses = []
    warmup = warmup_steps(spec)
    for i in range(warmup): trainer.train_step(i)
    sync()
    if trainer.captured is None or trainer.captured.graph is None: raise SystemExit("the step was not captured in a CUDA graph")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    kernels_of = lambda prof: _kineto_lists(prof)[2]     # (name, correlation id, ns, start ns) of each device event
    t0 = time.time(); start.record()
    for i in range(warmup, warmup + spec["steps"]): losses.append(trainer.train_step(i)["loss"])
    end.record(); sync(); windows["timed"] = (t0, time.time())
    step_ms = start.elapsed_time(end) / spec["steps"]
    at = warmup + spec["steps"]
    time.sleep(1.0)                       # the device idles, as before `rtrainer profile`'s one step
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.time(); start.record(); losses.append(trainer.train_step(at)["loss"]); end.record(); sync()
        windows["one step"] = (t0, time.time())
    profiled_ms = start.elapsed_time(end)
    events = kernels_of(prof)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:   # the same steps back to back, as in training
        t0 = time.time(); start.record()
        for i in range(at + 1, at + 1 + spec["steps"]): losses.append(trainer.train_step(i)["loss"])
        end.record(); sync(); windows["profiled run"] = (t0, time.time())
    run_events = kernels_of(prof)
    run_idle, _ = device_gaps(run_events, top=0)
    run = dict(step_ms=start.elapsed_time(end) / spec["steps"], kernel_sum_ms=sum(e[2] for e in run_events) / 1e6 / spec["steps"],
               device_idle_ms=run_idle / spec["steps"], kernels=len(run_events) / spec["steps"])
    losses = [float(v) for v in losses]
    del trainer, prof; gc.collect(); torch.cuda.empty_cache()
    smi.terminate(); smi.wait()
    clocks = sm_clocks(smi_log, windows)
    ceilings = measure_ceilings(device)
    rows = attribute_device_events([], {}, events)   # a replayed graph has no phase ranges: every row is 'other.KERNEL'
    idle_ms, gaps = device_gaps(events, top=len(events))
    gap_us = sorted(g["us"] for g in gaps)
    profile = dict(rows=rows, kernel_sum_ms=sum(r["ms"] for r in rows), full_step_without_profiler_ms=step_ms,
                   device_idle_ms=idle_ms, ceilings=ceilings)
    report = roofline_report(model_config(spec["config"]), spec["batch_size"], spec["seq_len"], profile)
    print(RESULT + json.dumps(dict(
        config=spec["config"], batch_size=spec["batch_size"], seq_len=spec["seq_len"], steps=spec["steps"], losses=losses,
        step_ms=step_ms, profiled_step_ms=profiled_ms, profiled_run=run, clocks=clocks, kernels=len(events), kernel_sum_ms=profile["kernel_sum_ms"],
        device_idle_ms=idle_ms, gaps=len(gap_us), median_gap_us=gap_us[len(gap_us) // 2] if gap_us else None,
        largest_gaps=gaps[:8], ceilings=ceilings, roofline=report, rows=rows[:60])), flush=True)

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="rb100m,prof183m,dense1b,moe4b"); p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3); p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=240)
    a = p.parse_args()
    from rtrainer.model import REFERENCE_BATCH
    results = []
    for config in [c for c in a.configs.split(",") if c]:
        spec = dict(config=config, batch_size=REFERENCE_BATCH[config], seq_len=a.seq_len, warmup=a.warmup, steps=a.steps,
                    device="cuda", out_dir=tempfile.mkdtemp(prefix="graph-profile-"))
        try:
            r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=a.timeout)
            found = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
            res = json.loads(found[-1][len(RESULT):]) if found else dict(config=config, status=f"failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-600:]}")
        except subprocess.TimeoutExpired:
            res = dict(config=config, status=f"timed out after {a.timeout} s")
        results.append(res)
        if "status" in res: print(f"{config}: {res['status']}", flush=True); continue
        print(f"\n{config} B={res['batch_size']}: {res['kernels']} kernels, step {res['step_ms']:.2f} ms "
              f"(profiled {res['profiled_step_ms']:.2f}), kernels {res['kernel_sum_ms']:.2f}, idle {res['device_idle_ms']:.2f} ms "
              f"in {res['gaps']} gaps (median {res['median_gap_us']:.2f} us); losses {[round(v, 3) for v in res['losses'][-3:]]}")
        r = res["profiled_run"]
        print(f"  {res['steps']} steps back to back under the profiler: {r['step_ms']:.2f} ms a step, kernels {r['kernel_sum_ms']:.2f}, "
              f"idle {r['device_idle_ms']:.2f}; SM MHz / W (samples): " +
              ", ".join(f"{k} {v[0]:.0f} / {v[1]:.0f} ({v[2]})" for k, v in res["clocks"].items() if v))
        for g in res["largest_gaps"][:4]: print(f"  gap {g['us']:8.1f} us at {g['at_ms']:8.3f} ms after {g['after'][:60]!r} before {g['before'][:60]!r}")
    print(f"\n{'config':9} {'step ms':>8} {'floor':>7} {'kernels':>8} {'idle':>6} {'rest':>6} " +
          " ".join(f"{f[:10]:>10}" for f in ("GEMM", "attention", "norms and pointwise", "MoE routing", "optimizer", "other")) + "   (family: measured - floor, ms)")
    for res in results:
        if "status" in res: continue
        rep, m = res["roofline"], res["roofline"]["measured"]
        fam = {f["family"]: f["gap_ms"] for f in rep["families"]}
        print(f"{res['config']:9} {m['step_ms']:8.2f} {rep['floor_ms']:7.2f} {m['kernel_sum_ms']:8.2f} {m['launch_gaps_ms']:6.2f} "
              f"{m['remainder_ms']:6.2f} " + " ".join(f"{fam[f]:10.2f}" for f in fam))
    import triton
    out = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__, triton=triton.__version__, device=torch.cuda.get_device_name(),
               commit=os.environ.get("RTRAINER_COMMIT"), method=__doc__.split("\n\n")[1].replace("\n", " "), results=results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "graph_step_profile.json"), "w") as f: json.dump(out, f, indent=1)

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
