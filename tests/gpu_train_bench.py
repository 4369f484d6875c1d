"""Paired training-throughput measurement on a GPU: `python tests/gpu_train_bench.py --arms CFG:B:IMPL[:CKPT],... --rounds R`
(CKPT: the arm's --activation-checkpointing, none unless given).

Each arm is `rtrainer train CFG --data DATA` (synthetic tokens unless --data names a shard directory) in its own process (so memory and failures are per arm),
arms alternated round by round (order reversed every other round). Throughput is over the second half of the steps
(the first half holds compilation and autotuning), valid only when every logged loss is finite. Writes data/results/NAME.json and prints a table.
"""
import argparse, json, subprocess, sys, tempfile, time
from pathlib import Path
import statistics as st
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rtrainer.kernels import save_results, alternation, ratio_interval          # the kernels chapter's paired statistics
from rtrainer.profiling import tokens_per_s_from_metrics                          # the profiling chapter's throughput reader
from rtrainer.training import NonFiniteLoss, compare_loss_curves                   # the training chapter's curve comparison

def run_arm(config, batch, impl, steps, seq_len, extra, data="synthetic", ckpt="none"):
    out = Path(tempfile.mkdtemp(prefix=f"arm-{config}-{impl}-"))
    cmd = [sys.executable, "-m", "rtrainer", "train", config, "--data", data, "--impl", impl, "--batch-size", str(batch),
           "--seq-len", str(seq_len), "--steps", str(steps), "--log-every", "1", "--eval-every", "0",
           "--out-dir", str(out), "--no-progress", "--no-checkpoints", "--no-cuda-graph", *extra,
           *(["--activation-checkpointing", ckpt] if ckpt != "none" else [])]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True)
    row = dict(config=config, batch=batch, impl=impl, wall_s=round(time.time() - t0, 1), **({"activation_checkpointing": ckpt} if ckpt != "none" else {}))
    metrics = out / "metrics.jsonl"
    if r.returncode != 0 or not metrics.exists():
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        row.update(status="out of memory" if "out of memory" in r.stderr.lower() else f"failed: {err[:200]}")
        return row
    try: tps, timed = tokens_per_s_from_metrics(metrics, steps // 2, batch * seq_len)   # the second half of the steps
    except NonFiniteLoss: row.update(status="rejected: non-finite loss"); return row
    logged = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line]
    row["losses"] = [round(x["loss"], 5) for x in logged]
    row["grad_norms"] = [round(x["grad_norm"], 5) for x in logged if x.get("grad_norm") is not None]
    if any("dropped_fraction" in x for x in logged): row["dropped_fractions"] = [round(x["dropped_fraction"], 5) for x in logged]   # MoE models
    mfus = [x["mfu"] for x in timed if x.get("mfu")]
    row.update(status="ok", tokens_per_s=tps, mfu=sum(mfus) / len(mfus) if mfus else None,
               peak_memory_gib=max((x.get("peak_memory_gib") or 0) for x in timed) or None, final_loss=timed[-1]["loss"])
    return row

def curve_comparison(runs, window=20):
    "Triton against torch loss curves of one config (same seed, same data), in the keys the recorded results use."
    by_impl = {r["impl"]: r["losses"] for r in runs}
    if not {"torch", "triton"} <= set(by_impl): return None
    c = compare_loss_curves(by_impl["torch"], by_impl["triton"], window)
    renamed = {"final_reference": "final_torch", "final_other": "final_triton", "reference_noise": "torch_noise"}
    return c and {renamed.get(k, k): v for k, v in c.items()}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", required=True, help="CFG:BATCH:IMPL[:ACTIVATION_CHECKPOINTING],...")
    ap.add_argument("--rounds", type=int, default=2); ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=1024); ap.add_argument("--name", default="training_throughput")
    ap.add_argument("--extra", default="", help="extra flags for every arm")
    ap.add_argument("--data", default="synthetic", help="token shards for every arm (default: synthetic tokens)")
    a = ap.parse_args()
    arms = [tuple((x.split(":") + ["none"])[:4]) for x in a.arms.split(",")]
    key = lambda r: (r["config"], str(r["batch"]), r["impl"], r.get("activation_checkpointing", "none"))
    results = []
    for rnd in range(a.rounds):
        for cfg, b, impl, ckpt in alternation(arms, rnd):
            row = run_arm(cfg, int(b), impl, a.steps, a.seq_len, a.extra.split(), a.data, ckpt)
            row["round"] = rnd; results.append(row); print(json.dumps(row), flush=True)
    summary = []
    for arm in arms:
        cfg, b, impl, ckpt = arm
        ok = [r["tokens_per_s"] for r in results if key(r) == arm and r["status"] == "ok"]
        mem = [r["peak_memory_gib"] for r in results if key(r) == arm and r["status"] == "ok" and r.get("peak_memory_gib")]
        mfu = [r["mfu"] for r in results if key(r) == arm and r["status"] == "ok" and r["mfu"]]
        status = "ok" if ok else next(r["status"] for r in results if key(r) == arm)
        summary.append(dict(config=cfg, batch=int(b), impl=impl, **({"activation_checkpointing": ckpt} if ckpt != "none" else {}), status=status, n=len(ok),
                            tokens_per_s=st.mean(ok) if ok else None, spread=(max(ok) - min(ok)) if ok else None,
                            mfu=st.mean(mfu) if mfu else None, peak_memory_gib=max(mem) if mem else None))
    # paired ratio triton / torch per config, by round, with a t interval on log ratios
    for cfg in dict.fromkeys(c for c, _, _, _ in arms):
        ratios = []
        for rnd in range(a.rounds):
            got = {r["impl"]: r.get("tokens_per_s") for r in results if r["config"] == cfg and r["round"] == rnd and r["status"] == "ok"}
            if "triton" in got and "torch" in got: ratios.append(got["triton"] / got["torch"])
        if ratios:
            ratio, low, high = ratio_interval(ratios)
            summary.append(dict(config=cfg, impl="ratio triton/torch", status="ok", n=len(ratios), ratio=ratio,
                                ratio_low=low if low is not None else float("nan"), ratio_high=high if high is not None else float("nan")))
    curves = {cfg: curve_comparison([r for r in results if r["config"] == cfg and r["status"] == "ok" and r["round"] == 0])
              for cfg in dict.fromkeys(c for c, _, _, _ in arms)}
    for cfg, c in curves.items():
        if c: print(f"{cfg}: loss curves triton vs torch over {c['steps']} steps: final (mean of last {c['window']}) "
                    f"{c['final_torch']:.4f} vs {c['final_triton']:.4f} (diff {c['final_diff']:+.4f}); largest gap of the "
                    f"{c['window']}-step means {c['max_smoothed_gap']:.4f}; step-to-step spread of the torch curve there {c['torch_noise']:.4f}")
    save_results(a.name, summary, curves=curves, data=a.data, extra=a.extra, runs=results, steps=a.steps, seq_len=a.seq_len, protocol="arms alternated per round, each in its own process; last logging window")
    print(f"{'config':9} {'B':>3} {'impl':20} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9}  status")
    for s in summary:
        if "ratio" in s: print(f"{s['config']:9} {'':>3} {s['impl']:20} ratio {s['ratio']:.3f} [{s['ratio_low']:.3f}, {s['ratio_high']:.3f}] (n={s['n']})")
        else: print(f"{s['config']:9} {s['batch']:>3} {s['impl'] + ' ' + s.get('activation_checkpointing', ''):20} {s['tokens_per_s'] or 0:>10,.0f} {100*(s['mfu'] or 0):>5.1f}% {s['peak_memory_gib'] or 0:>9.1f}  {s['status']}")

if __name__ == "__main__": main()
