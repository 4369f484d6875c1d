"""What the trainer experiment scripts share (`step_sync_check.py`, `graph_step_check.py`, in experiments/): their command line, a
Trainer on synthetic data for an arm's process, its warm-up, the arm's result line, and the alternated rounds of fresh processes,
summarized with the profiling chapter's `summarize_pairs` and `print_summary` and written to $OUT/NAME.json. Also the reader of
an nvidia-smi clock and power log (`smi_samples`), for them and `attention_sustained.py`."""
import argparse, json, math, os, subprocess, sys, tempfile, time
import torch

RESULT = "ARM_RESULT "

def arguments(doc, arms, steps=4):
    "The scripts' shared flags; `--arms` is checked against `arms`."
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--config", default="rb100m"); p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024); p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3); p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--device", default="cuda"); p.add_argument("--timeout", type=int, default=150)
    p.add_argument("--arms", default=",".join(arms))
    a = p.parse_args()
    a.arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in a.arms if x not in arms]
    if unknown: sys.exit(f"{os.path.basename(sys.argv[0])}: unknown arms {unknown}; choose from {list(arms)}")
    return a

def synthetic_trainer(spec, **train_config):
    "The Trainer of one arm's process: `spec`'s config, batch and sequence length on synthetic data, no warm-up, quiet."
    from rtrainer.model import model_config
    from rtrainer.training import TrainConfig, Trainer
    tcfg = TrainConfig(model=spec["config"], data="synthetic", batch_size=spec["batch_size"], seq_len=spec["seq_len"],
                       steps=10**6, warmup=0, eval_every=0, progress=False, device=spec["device"], out_dir=spec["out_dir"],
                       **{"cuda_graph": "off", **train_config})   # eager steps unless an arm asks for the graph
    mcfg = model_config(spec["config"], max_seq_len=max(spec["seq_len"], model_config(spec["config"]).max_seq_len))
    return Trainer(tcfg, mcfg, log=lambda *a: None)

def warmup_steps(spec):
    "Steps to run before timing: spec's warm-up, and at least the trainer's eager steps and its CUDA graph's capture."
    from rtrainer.training import GRAPH_WARMUP_STEPS
    return max(spec["warmup"], GRAPH_WARMUP_STEPS + 1)

def smi_samples(path):
    """The samples of an `nvidia-smi --query-gpu=timestamp,... --format=csv,noheader,nounits -lms N` log: (host seconds,
    value, ...) tuples, the timestamp read as the host's local time (as `time.time()` counts); other lines skipped."""
    from datetime import datetime
    samples = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try: samples.append((datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), *map(float, parts[1:])))
        except (ValueError, IndexError): continue       # a line nvidia-smi wrote otherwise
    return samples

def report(spec, seconds, losses, **extra):
    "Print the arm's result line: tokens/s over `seconds` of spec['steps'] steps, or a status if a loss is not finite."
    values = [float(l) for l in losses]
    result = dict(arm=spec["arm"], step_ms=seconds / spec["steps"] * 1e3, losses=values,
                  tokens_per_s=spec["batch_size"] * spec["seq_len"] * spec["steps"] / seconds, **extra)
    if not all(math.isfinite(v) for v in values): result = dict(arm=spec["arm"], status=f"non-finite loss {values}")
    print(RESULT + json.dumps(result), flush=True)

def run_child(script, spec, timeout):
    "Run `script --child SPEC` in a fresh process; its result dict (status says what went wrong if it failed)."
    try:
        r = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(arm=spec["arm"], status=f"timed out after {timeout} s")
    found = [l for l in r.stdout.splitlines() if l.startswith(RESULT)]
    if found: return json.loads(found[-1][len(RESULT):])
    return dict(arm=spec["arm"], status=f"failed (exit {r.returncode}): {(r.stderr or r.stdout).strip()[-600:]}")

def alternated_rounds(script, a, reference, name, describe=lambda res: ""):
    """Each arm of `a.arms` in its own process of `script`, alternated over `a.rounds` rounds; prints each run and the
    summary (speed ratio `reference`/arm with its 95% interval); writes $OUT/`name`.json. Returns (rows, results)."""
    from rtrainer.kernels import alternation
    from rtrainer.profiling import summarize_pairs, print_summary
    base = dict(config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, warmup=a.warmup, steps=a.steps,
                device=a.device, out_dir=tempfile.mkdtemp(prefix=name + "-"))
    results = {arm: [] for arm in a.arms}
    for r in range(a.rounds):
        for arm in alternation(a.arms, r):
            res = run_child(script, dict(base, arm=arm), a.timeout)
            results[arm].append(res)
            print(f"round {r + 1} {arm}: " + (f"{res['tokens_per_s']:,.0f} tokens/s, {res['step_ms']:.2f} ms per step{describe(res)}"
                                              if "tokens_per_s" in res else res["status"]), flush=True)
    rows = summarize_pairs(a.arms, results, reference if reference in a.arms else a.arms[0])
    print_summary(rows, f"\n{a.config} B={a.batch_size} T={a.seq_len}: {a.rounds} rounds of {a.steps} steps after {a.warmup}")
    out = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), torch=torch.__version__,
               device=torch.cuda.get_device_name() if a.device == "cuda" and torch.cuda.is_available() else a.device,
               config=a.config, batch_size=a.batch_size, seq_len=a.seq_len, rounds=a.rounds, warmup=a.warmup, steps=a.steps,
               rows=rows, raw=results)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], name + ".json"), "w") as f: json.dump(out, f, indent=1)
    return rows, results
