"""What the trainer's one host synchronization per step costs on a host-bound model, and whether Python's garbage
collector is behind the spread of rtrainer's `versus` rounds at rb100m (548,228 to 583,275 tokens/s between processes
at commit 283fad2, where torch.compile's rounds stayed within 0.2%).

Up to commit 87f1121, `Trainer.train_step` read the loss and the gradient norm on the host before the optimizer step,
so that a non-finite step stopped before it touched the weights. That read waits for the whole backward: the GPU then
idles while the host launches the optimizer and the next step's first kernels. Measured here at that commit (H200,
3 rounds): trainer 549,311 tokens/s with a 19.6% spread between rounds, no-sync 606,253 with 1.4%. Since then the
trainer computes the clip coefficient on the device, skips a non-finite step's update there, and reads a step's loss
and norm one step late. Measured again at commit fbe2962 (3 rounds): trainer 570,222 tokens/s, no-sync 577,587,
1.013 [0.854, 1.200], both arms' rounds spread by 6 to 9%. The arms, each a fresh process, alternated over
ROUNDS rounds, WARMUP steps and then STEPS timed ones:

  trainer           Trainer.train_step as it is
  no-sync           the same device work without the read: the gradient norm is computed but not read, the update
                    runs at the clip coefficient 1, and the losses are read after the timed window. An upper bound on
                    what a device-side guard (skip the update on a non-finite step, check one step late) would buy.
  trainer-gc-off    the trainer with Python's garbage collector off over the timed steps (gc.collect() first)
  no-sync-gc-off    both

Every loss of the timed window must be finite. Prints each round and a paired ratio to `trainer` with its 95% interval.
`python tests/step_sync_check.py [--config rb100m] [--batch-size 32] [--rounds 3]` on a GPU; writes
$OUT/step_sync_check.json when OUT is set. `--device cpu --config tiny` runs it on a CPU (TRITON_INTERPRET=1)."""
import argparse, gc, json, math, os, subprocess, sys, time
import torch

ARMS = ("trainer", "no-sync", "trainer-gc-off", "no-sync-gc-off")
RESULT = "STEP_SYNC_RESULT "

def child(spec):
    from rtrainer.model import model_config
    from rtrainer.training import TrainConfig, Trainer
    from rtrainer.moe import load_balance_weight
    device = torch.device(spec["device"])
    tcfg = TrainConfig(model=spec["config"], data="synthetic", batch_size=spec["batch_size"], seq_len=spec["seq_len"],
                       steps=10**6, warmup=0, eval_every=0, progress=False, device=str(device), out_dir=spec["out_dir"])
    mcfg = model_config(spec["config"], max_seq_len=max(spec["seq_len"], model_config(spec["config"]).max_seq_len))
    trainer = Trainer(tcfg, mcfg, log=lambda *a: None)
    no_sync = spec["arm"].startswith("no-sync")

    def step_without_sync(i):
        c, opt = trainer.cfg, trainer.optimizer
        lr = trainer.lr_at(i)
        lbw = load_balance_weight(i, c.load_balance_weight, c.load_balance_decay_steps)
        opt.zero_grad()
        lm_total = torch.zeros((), device=device)
        for inputs, targets, mask in trainer.micro_batches(i):
            lm, _ = trainer.forward_backward(inputs, targets, mask, lbw)
            lm_total += lm.float()
        norm = opt.grad_norm()                    # the same device work as the trainer's step, never read here
        opt.step(lr, grad_scale=1.0 / c.accumulation)
        return lm_total / c.accumulation, norm

    losses = []
    def step(i):
        if no_sync: losses.append(step_without_sync(i)[0])
        else: losses.append(trainer.train_step(i)["loss"])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for i in range(spec["warmup"]): step(i)
    sync(); del losses[:]
    gc_off = spec["arm"].endswith("gc-off")
    if gc_off: gc.collect(); gc.disable()
    collections = sum(s["collections"] for s in gc.get_stats())
    t0 = time.perf_counter()
    for i in range(spec["warmup"], spec["warmup"] + spec["steps"]): step(i)
    sync(); seconds = time.perf_counter() - t0
    collections = sum(s["collections"] for s in gc.get_stats()) - collections
    if gc_off: gc.enable()
    values = [float(l) for l in losses]
    result = dict(arm=spec["arm"], step_ms=seconds / spec["steps"] * 1e3, gc_collections=collections,
                  tokens_per_s=spec["batch_size"] * spec["seq_len"] * spec["steps"] / seconds, losses=values)
    if not all(math.isfinite(v) for v in values): result = dict(arm=spec["arm"], status=f"non-finite loss {values}")
    print(RESULT + json.dumps(result), flush=True)

def run_arm(spec, timeout):
    try:
        r = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(arm=spec["arm"], status=f"timed out after {timeout} s")
    found = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
    if found: return json.loads(found[-1][len(RESULT):])
    return dict(arm=spec["arm"], status=f"failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-400:]}")

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="rb100m"); p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024); p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3); p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda"); p.add_argument("--timeout", type=int, default=150)
    p.add_argument("--arms", default=",".join(ARMS))
    a = p.parse_args()
    from rtrainer.kernels import ratio_interval, alternation
    import tempfile
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown: sys.exit(f"step_sync_check: unknown arms {unknown}; choose from {list(ARMS)}")
    base = dict(config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, warmup=a.warmup, steps=a.steps,
                device=a.device, out_dir=tempfile.mkdtemp(prefix="step-sync-"))
    results = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in alternation(arms, r):
            res = run_arm(dict(base, arm=arm), a.timeout)
            results[arm].append(res)
            print(f"round {r + 1} {arm}: " + (f"{res['tokens_per_s']:,.0f} tokens/s, {res['step_ms']:.2f} ms per step, "
                                              f"{res['gc_collections']} gc collections" if "tokens_per_s" in res else res["status"]), flush=True)
    rows = []
    for arm in arms:
        ok = [x["tokens_per_s"] for x in results[arm] if "tokens_per_s" in x]
        row = dict(arm=arm, rounds=len(ok), tokens_per_s=sum(ok) / len(ok) if ok else None,
                   spread=(max(ok) - min(ok)) / max(ok) if ok else None)
        base_runs = results[arms[0]]
        pairs = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(results[arm], base_runs) if "tokens_per_s" in x and "tokens_per_s" in b]
        if arm != arms[0] and pairs:
            row["speed_vs_" + arms[0]], row["ci95_low"], row["ci95_high"] = ratio_interval(pairs)
        rows.append(row)
    print(f"\n{a.config} B={a.batch_size} T={a.seq_len}: {a.rounds} rounds of {a.steps} steps after {a.warmup}")
    for row in rows:
        tps = f"{row['tokens_per_s']:,.0f}" if row["tokens_per_s"] else "-"
        spread = f"{100 * row['spread']:.1f}%" if row["spread"] is not None else "-"
        ratio = (f"{row['speed_vs_' + arms[0]]:.3f} [{row['ci95_low'] or float('nan'):.3f}, {row['ci95_high'] or float('nan'):.3f}]"
                 if "speed_vs_" + arms[0] in row else "")
        print(f"{row['arm']:18s} {tps:>12s} tokens/s  spread {spread:>6s}  {ratio}")
    out = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__,
               device=torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else a.device,
               config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, rounds=a.rounds, warmup=a.warmup, steps=a.steps,
               rows=rows, raw=results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "step_sync_check.json"), "w") as f: json.dump(out, f, indent=1)

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child": child(json.loads(sys.argv[2]))
    else: main()
