"""Where the eager trainer's host time goes at a batch too small to hide it: rb100m at 1x512 on the H200 takes about
45 ms a step eagerly against 4 ms as one CUDA graph (versus_rb100m_small_*.json), so the step is the host's time.
This script times eager steps, then profiles the same steps twice: cProfile (which Python functions hold the host)
and torch.profiler (how many kernel launches, and the host time the launch calls take), and times eager steps with
`rtrainer.kernels.launch`'s direct path against Triton's binding, `--rounds` alternated rounds. The account and what came of
it: experiments/eager_host_time.md.

`python experiments/eager_host_time.py [--config rb100m] [--batch-size 1] [--seq-len 512] [--steps 20]` on a GPU
(stage eager-host); writes $OUT/eager_host_time.json and $OUT/eager_host_time.txt when OUT is set."""
import argparse, cProfile, io, json, os, pstats, tempfile, time
import torch

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="rb100m"); p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=512); p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    from arm_rounds import synthetic_trainer
    import rtrainer.optimizer as optimizer
    spec = dict(arm="trainer", config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, device="cuda",
                out_dir=tempfile.mkdtemp(prefix="rtrainer-host-"))
    trainer = synthetic_trainer(spec)
    losses, step_no = [], [0]
    def steps(n):
        for _ in range(n): losses.append(trainer.train_step(step_no[0])["loss"]); step_no[0] += 1
        torch.cuda.synchronize()
    steps(5)
    builds = dict(optimizer.TABLE_BUILDS)
    t0 = time.perf_counter(); steps(a.steps); wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
    table_builds = {k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds}
    prof = cProfile.Profile(); prof.enable(); steps(a.steps); prof.disable()
    text = io.StringIO(); st = pstats.Stats(prof, stream=text); st.sort_stats("tottime").print_stats(30)
    st.sort_stats("cumulative").print_stats(40)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as tp:
        steps(a.steps)
    events = tp.key_averages()
    launches = [e for e in events if "LaunchKernel" in e.key or "cuLaunch" in e.key or "LaunchKernelEx" in e.key]
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    top_cpu = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
    import rtrainer.kernels as K                      # kernels.launch's direct path against Triton's binding, paired
    def step_ms(direct):
        K.DIRECT_LAUNCHES = direct
        try:
            t0 = time.perf_counter(); steps(a.steps); return (time.perf_counter() - t0) / a.steps * 1e3
        finally: K.DIRECT_LAUNCHES = True
    paired = {True: [], False: []}
    for r in range(a.rounds):
        for direct in K.alternation([True, False], r): paired[direct].append(step_ms(direct))
    direct_vs_binding = K.ratio_interval([b / d for d, b in zip(paired[True], paired[False])])   # > 1: direct is faster
    print("eager step ms, direct launches", [round(x, 2) for x in paired[True]], "Triton's binding",
          [round(x, 2) for x in paired[False]], "speed-up %.3f [%.3f, %.3f]" % direct_vs_binding, flush=True)
    result = dict(config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, steps=a.steps, eager_step_ms=wall_ms,
                  direct_launch_step_ms=paired[True], binding_step_ms=paired[False], direct_speedup=direct_vs_binding,
                  commit=os.environ.get("RTRAINER_COMMIT"),
                  final_loss=float(losses[-1]), table_builds_timed=table_builds,
                  launches_per_step={e.key: e.count / a.steps for e in launches},
                  launch_host_ms_per_step=sum(e.self_cpu_time_total for e in launches) / a.steps / 1e3,
                  kernels_per_step=kernels / a.steps, kernel_ms_per_step=gpu_us / a.steps / 1e3,
                  top_host_ops=[dict(name=e.key[:80], calls_per_step=e.count / a.steps, self_host_ms_per_step=e.self_cpu_time_total / a.steps / 1e3)
                                for e in top_cpu])
    summary = json.dumps({k: v for k, v in result.items() if k != "top_host_ops"}, indent=1)
    ops = "\n".join(f"{o['self_host_ms_per_step']:8.3f} ms {o['calls_per_step']:7.1f}x  {o['name']}" for o in result["top_host_ops"])
    print(summary); print(ops); print(text.getvalue()[:12000])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "eager_host_time.json"), "w") as f: json.dump(result, f, indent=1)
        with open(os.path.join(os.environ["OUT"], "eager_host_time.txt"), "w") as f: f.write(summary + "\n" + ops + "\n" + text.getvalue())

if __name__ == "__main__": main()
