"""Does freeing the fp32 gradient buffers between steps (AdamW.zero_grad -> start_gradient_step(release=True)) cost
time, and does the CUDA allocator's expandable segments mode change that? Runs rtrainer's training arm of
`rtrainer versus` (moe4b by default) in a fresh process per variant, alternated over rounds, and prints tokens/s,
the peak allocated and reserved memory and the allocator's retries (cudaFree of its cache after a failed cudaMalloc).

    python experiments/grad_release_check.py            # GPU; writes $OUT/grad_release_check.json when OUT is set"""
import json, os, statistics, subprocess, sys, time

CONFIG = os.environ.get("RELEASE_CONFIG", "moe4b")
ROUNDS = int(os.environ.get("RELEASE_ROUNDS", "1"))
VARIANTS = {   # name: (keep the buffers between steps, PYTORCH_CUDA_ALLOC_CONF; rtrainer's import defaults it to expandable segments)
    "release": (False, "expandable_segments:False"),
    "keep": (True, "expandable_segments:False"),
    "release + expandable segments": (False, "expandable_segments:True"),
}
if os.environ.get("RELEASE_VARIANTS"): VARIANTS = {n: VARIANTS[n] for n in os.environ["RELEASE_VARIANTS"].split(",")}
CODE = """
import json, sys, torch
import rtrainer.kernels as K, rtrainer.optimizer as O
if sys.argv[2] == "keep": O.AdamW.zero_grad = lambda self: K.start_gradient_step(self.params)   # the old behaviour
from rtrainer.profiling import run_arm
result = run_arm(json.loads(sys.argv[1]))
stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
if stats: result.update(peak_reserved_gib=stats["reserved_bytes.all.peak"] / 2**30, alloc_retries=stats["num_alloc_retries"],
              cuda_mallocs=stats["segment.all.allocated"], cuda_frees=stats["segment.all.freed"])
print("RESULT " + json.dumps(result))
"""

def run(name):
    keep, alloc = VARIANTS[name]
    from rtrainer.model import REFERENCE_BATCH
    spec = dict(arm="rtrainer", config=CONFIG, overrides={}, batch_size=REFERENCE_BATCH.get(CONFIG, 8), seq_len=1024 if CONFIG in REFERENCE_BATCH else 64, warmup=3, steps=4, peak_tflops=989.4)
    env = dict(os.environ)
    env["PYTORCH_CUDA_ALLOC_CONF"] = alloc
    r = subprocess.run([sys.executable, "-c", CODE, json.dumps(spec), "keep" if keep else "release"], capture_output=True, text=True, env=env, timeout=240)
    found = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    return json.loads(found[-1][7:]) if found else dict(status=f"failed (exit {r.returncode}): {r.stderr[-400:]}")

def main():
    rows = {name: [] for name in VARIANTS}
    for rnd in range(ROUNDS):
        order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]
        for name in order:
            t0 = time.time()
            res = run(name)
            rows[name].append(res)
            print(f"round {rnd + 1} {name:30} {res.get('tokens_per_s', float('nan')):9,.0f} tok/s  peak {res.get('peak_memory_gib', float('nan')):6.1f} GiB"
                  f"  reserved {res.get('peak_reserved_gib', float('nan')):6.1f} GiB  retries {res.get('alloc_retries')}  mallocs {res.get('cuda_mallocs')}"
                  f"  frees {res.get('cuda_frees')}  {res.get('status', '')} ({time.time() - t0:.0f} s)", flush=True)
    print(f"\n{'variant':30} {'tok/s':>9} {'peak GiB':>9} {'reserved':>9} {'retries':>8}")
    for name, rs in rows.items():
        ok = [r for r in rs if r.get("tokens_per_s")]
        if not ok: print(f"{name:30} failed"); continue
        print(f"{name:30} {statistics.mean(r['tokens_per_s'] for r in ok):9,.0f} {max(r.get('peak_memory_gib', float('nan')) for r in ok):9.1f}"
              f" {max(r.get('peak_reserved_gib', float('nan')) for r in ok):9.1f} {max(r.get('alloc_retries', -1) for r in ok):8d}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "grad_release_check.json"), "w") as f:
            json.dump(dict(config=CONFIG, rounds=ROUNDS, variants=rows), f, indent=1)

if __name__ == "__main__":
    main()
