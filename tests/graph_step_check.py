"""What capturing rtrainer's whole training step in one CUDA graph would buy on a model whose step is bound by the
host's launches. At rb100m on the H200 (commit fbe2962) the step takes 56.1 ms for 50.7 ms of kernels, about 750
launches: the GPU waits for the host about a tenth of the time even though the loop never waits for the GPU.

An experiment, not the trainer: it changes nothing in the package, and patches what a capture needs in this process.
- The fp32 gradient buffers are kept from step to step (`start_gradient_step(release=False)`), and autograd's `.grad`
  tensors too, zeroed in place, so every gradient sits at the same address in each step. The fused optimizer's
  address tables are then built before the capture and found in their cache during it; a table built during the
  capture would copy from a temporary pinned buffer that a replay reads after it is freed, so this script makes
  any such rebuild an error.
- The learning rate, the load-balance weight and AdamW's bias corrections are the capture step's on every replay
  (the kernels take them as launch arguments). The clip coefficient is already computed on the device. Throughput
  does not depend on those numbers; the losses only have to stay finite, and they are printed.
- Each step's batch is copied into the captured inputs before the replay.

Arms, each a fresh process, alternated over ROUNDS rounds, WARMUP steps and then STEPS timed ones:

  trainer      Trainer.train_step as it is (gradient buffers freed between steps)
  persistent   the step body below, run eagerly, gradients kept at fixed addresses
  graph        the same body captured once in a CUDA graph and replayed

`python tests/graph_step_check.py [--config rb100m] [--rounds 3]` on a GPU; writes $OUT/graph_step_check.json when
OUT is set. `--device cpu --config tiny --arms trainer,persistent` runs the eager arms on a CPU (TRITON_INTERPRET=1)."""
import argparse, json, math, os, subprocess, sys, tempfile, time
import torch

ARMS = ("trainer", "persistent", "graph")
RESULT = "GRAPH_STEP_RESULT "

def child(spec):
    import rtrainer.optimizer as optimizer
    from rtrainer.kernels import start_gradient_step
    from rtrainer.model import model_config
    from rtrainer.optimizer import clip_scale
    from rtrainer.training import TrainConfig, Trainer
    from rtrainer.moe import load_balance_weight
    device = torch.device(spec["device"])
    cuda = device.type == "cuda"
    tcfg = TrainConfig(model=spec["config"], data="synthetic", batch_size=spec["batch_size"], seq_len=spec["seq_len"],
                       steps=10**6, warmup=0, eval_every=0, progress=False, device=str(device), out_dir=spec["out_dir"])
    mcfg = model_config(spec["config"], max_seq_len=max(spec["seq_len"], model_config(spec["config"]).max_seq_len))
    trainer = Trainer(tcfg, mcfg, log=lambda *a: None)
    c, opt, arm = trainer.cfg, trainer.optimizer, spec["arm"]
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    losses, notes = [], {}

    if arm == "trainer":
        def step(i): losses.append(trainer.train_step(i)["loss"])
    else:
        inputs, targets, _ = next(iter(trainer.micro_batches(0)))
        static_inputs, static_targets = inputs.clone(), targets.clone()

        def zero_grad():                                  # gradients stay where they are: same addresses every step
            kept = [(p, p.grad) for p in opt.params if p.grad is not None]
            start_gradient_step(opt.params, release=False)
            for p, g in kept: p.grad = g.zero_()

        def body(i):
            zero_grad()
            lm, lb = trainer.forward_backward(static_inputs, static_targets, None,
                                              load_balance_weight(i, c.load_balance_weight, c.load_balance_decay_steps))
            norm = opt.grad_norm()
            opt.step(trainer.lr_at(i), grad_scale=clip_scale(norm, c.clip, 1.0, also_finite=[lm]))
            return lm.detach().float(), norm

        def load_batch(i):
            x, y, _ = next(iter(trainer.micro_batches(i)))
            static_inputs.copy_(x, non_blocking=True); static_targets.copy_(y, non_blocking=True)

        for i in range(2): load_batch(i); body(i)         # eager: compiles the kernels, settles the gradient buffers
        sync()
        if arm == "persistent":
            def step(i): load_batch(i); losses.append(body(i)[0])
        else:
            if not cuda: sys.exit("graph_step_check: the graph arm needs a CUDA device")
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):                 # the warm-up PyTorch asks for before a capture
                for i in range(2, 4): load_batch(i); body(i)
            torch.cuda.current_stream(device).wait_stream(side)
            sync()
            builds = dict(optimizer.TABLE_BUILDS)
            real_to_device = optimizer._to_device
            def refuse(*a, **k): raise RuntimeError("an optimizer table was rebuilt during the capture (a gradient moved)")
            optimizer._to_device = refuse
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    static_loss, static_norm = body(4)
            finally: optimizer._to_device = real_to_device
            notes["table_builds_during_capture"] = {k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds}
            def step(i):
                load_batch(i); graph.replay()
                losses.append(static_loss.clone())
    for i in range(5, 5 + spec["warmup"]): step(i)
    sync(); del losses[:]
    builds = dict(optimizer.TABLE_BUILDS)
    t0 = time.perf_counter()
    for i in range(5 + spec["warmup"], 5 + spec["warmup"] + spec["steps"]): step(i)
    sync(); seconds = time.perf_counter() - t0
    values = [float(l) for l in losses]
    result = dict(arm=arm, step_ms=seconds / spec["steps"] * 1e3, tokens_per_s=spec["batch_size"] * spec["seq_len"] * spec["steps"] / seconds,
                  losses=values, peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
                  table_builds_timed={k: optimizer.TABLE_BUILDS[k] - builds[k] for k in builds}, **notes)
    if not all(math.isfinite(v) for v in values): result = dict(arm=arm, status=f"non-finite loss {values}")
    print(RESULT + json.dumps(result), flush=True)

def run_arm(spec, timeout):
    try:
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(arm=spec["arm"], status=f"timed out after {timeout} s")
    found = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
    if found: return json.loads(found[-1][len(RESULT):])
    return dict(arm=spec["arm"], status=f"failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-600:]}")

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="rb100m"); p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024); p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3); p.add_argument("--steps", type=int, default=8)
    p.add_argument("--device", default="cuda"); p.add_argument("--timeout", type=int, default=150)
    p.add_argument("--arms", default=",".join(ARMS))
    a = p.parse_args()
    from rtrainer.kernels import ratio_interval, alternation
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown: sys.exit(f"graph_step_check: unknown arms {unknown}; choose from {list(ARMS)}")
    base = dict(config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, warmup=a.warmup, steps=a.steps,
                device=a.device, out_dir=tempfile.mkdtemp(prefix="graph-step-"))
    results = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in alternation(arms, r):
            res = run_arm(dict(base, arm=arm), a.timeout)
            results[arm].append(res)
            print(f"round {r + 1} {arm}: " + (f"{res['tokens_per_s']:,.0f} tokens/s, {res['step_ms']:.2f} ms per step, losses "
                                              f"{[round(v, 3) for v in res['losses']]}" if "tokens_per_s" in res else res["status"]), flush=True)
    rows = []
    for arm in arms:
        ok = [x["tokens_per_s"] for x in results[arm] if "tokens_per_s" in x]
        row = dict(arm=arm, rounds=len(ok), tokens_per_s=sum(ok) / len(ok) if ok else None,
                   spread=(max(ok) - min(ok)) / max(ok) if ok else None)
        pairs = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(results[arm], results[arms[0]]) if "tokens_per_s" in x and "tokens_per_s" in b]
        if arm != arms[0] and pairs: row["speed_vs_" + arms[0]], row["ci95_low"], row["ci95_high"] = ratio_interval(pairs)
        rows.append(row)
    print(f"\n{a.config} B={a.batch_size} T={a.seq_len}: {a.rounds} rounds of {a.steps} steps after {a.warmup}")
    for row in rows:
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "-"
        spread = f"{100 * row['spread']:.1f}%" if row["spread"] is not None else "-"
        key = "speed_vs_" + arms[0]
        ratio = f"{row[key]:.3f} [{row['ci95_low'] or float('nan'):.3f}, {row['ci95_high'] or float('nan'):.3f}]" if key in row else ""
        print(f"{row['arm']:12s} {tps:>12s} tokens/s  spread {spread:>6s}  {ratio}")
    out = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__,
               device=torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else a.device,
               config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, rounds=a.rounds, warmup=a.warmup, steps=a.steps,
               rows=rows, raw=results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "graph_step_check.json"), "w") as f: json.dump(out, f, indent=1)

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
