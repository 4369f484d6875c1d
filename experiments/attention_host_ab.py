"""Two trees of the package, paired: host microseconds to enqueue one attention forward + backward through each tree's
rtrainer, at the four reference shapes, with cuDNN's step measured in the same process as an anchor.

Why: a change to the package's own Python (checks, descriptors, launch keys) is measured on the GPU against the
tree before it, in one machine session, each round a fresh process per tree, alternated (A B, B A, ...), the paired
ratio after / before with a 95% interval. Without a GPU the child runs `attention_host_sim.py`'s stand-in (device
checks answered as an H100's, launches that do nothing), so the same command checks itself on a CPU.

Run: `python experiments/attention_host_ab.py BEFORE_TREE AFTER_TREE [--rounds 4] [--calls 50]` where each tree holds
an `rtrainer/` folder (a `git archive` of the commit before, say). One untimed process per tree first compiles what
the Triton cache lacks. Writes $OUT/attention_host_ab.json after every round when OUT is set and prints a table last;
the table says where the two trees took different Hopper kernels.

This is an experiment, not part of rtrainer."""
import argparse, json, os, statistics, subprocess, sys, time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULT = "AB_RESULT "

def child(tree, calls):
    "One process, one tree: the step's host microseconds per shape (median of 5 batches of `calls` steps)."
    sys.path.insert(0, os.path.abspath(tree))
    import torch
    import rtrainer.attention as A
    import rtrainer.attention_hopper as H
    assert os.path.abspath(A.__file__).startswith(os.path.abspath(tree)), f"imported {A.__file__}, not {tree}'s rtrainer"
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        shapes = A.REFERENCE_ATTENTION_SHAPES
        from rtrainer.kernels import enqueue_ms
        def host_us(fn):                     # after one call (compiles): the median of 5 batches of `calls`, synchronized between
            fn()
            return statistics.median(enqueue_ms(fn, calls) for _ in range(5)) * 1e3
    else:                                   # the CPU stand-in: the tree's modules are already imported, so the sim patches them
        sys.path.insert(1, HERE)
        import attention_host_sim as sim
        sim.as_on_a_gpu()
        shapes = {name: (B, heads, KV, T, hd) for name, (B, T, heads, KV, hd) in sim.SHAPES.items()}
        host_us = lambda fn: sim.host_us(fn, calls)
    device = "cuda" if on_gpu else "cpu"
    result = {}
    for name, (B, heads, KV, T, hd) in shapes.items():
        q = torch.randn(B, T, heads, hd, dtype=torch.bfloat16, device=device, requires_grad=True)
        k, v = (torch.randn(B, T, KV, hd, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(2))
        do = torch.randn_like(q)
        flash = lambda: torch.autograd.grad(A.flash_attention(q, k, v), (q, k, v), do)
        H.CALLS.clear(); flash()
        row = dict(hopper="+".join(kind for kind in ("forward", "dq", "dkdv") if H.CALLS[kind]) or "none", flash=host_us(flash))
        if on_gpu:
            kr, vr = (t.detach().repeat_interleave(heads // KV, dim=2).requires_grad_() for t in (k, v))
            cudnn = A._sdpa_attention("CUDNN_ATTENTION", False)
            row["cudnn"] = host_us(lambda: torch.autograd.grad(cudnn(q, kr, vr), (q, kr, vr), do))
        result[name] = row
    print(RESULT + json.dumps(dict(tree=tree, module=A.__file__, steps=result)), flush=True)

def run_child(tree, calls, timeout):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", tree, "--calls", str(calls)],
                       capture_output=True, text=True, timeout=timeout)
    lines = [l for l in p.stdout.splitlines() if l.startswith(RESULT)]
    if p.returncode or not lines:
        sys.exit(f"attention_host_ab: the child for {tree} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])

def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trees", nargs="*", help="BEFORE_TREE AFTER_TREE")
    p.add_argument("--child"); p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=4); p.add_argument("--timeout", type=int, default=300)
    a = p.parse_args()
    if a.child: return child(a.child, a.calls)
    if len(a.trees) != 2: sys.exit("attention_host_ab: give two trees, BEFORE_TREE AFTER_TREE")
    for tree in a.trees:
        if not os.path.isfile(os.path.join(tree, "rtrainer", "attention_hopper.py")):
            sys.exit(f"attention_host_ab: {tree} holds no rtrainer/attention_hopper.py")
    sys.path.insert(0, os.path.dirname(HERE))
    from rtrainer.kernels import alternation, ratio_interval
    import torch, triton
    labels = dict(zip(("before", "after"), a.trees))
    for label in labels: run_child(labels[label], 5, a.timeout)       # untimed: compiles what the Triton cache lacks
    rounds = []
    for r in range(a.rounds):
        got = {label: run_child(labels[label], a.calls, a.timeout) for label in alternation(labels, r)}
        rounds.append({label: got[label]["steps"] for label in labels})
        print(f"round {r}:", {label: {s: round(v['flash'], 1) for s, v in steps.items()} for label, steps in rounds[-1].items()}, flush=True)
        table = summary(rounds, ratio_interval)
        payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (stand-in launches)",
                       torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("RTRAINER_COMMIT"),
                       trees=labels, rounds=len(rounds), calls=a.calls, steps=table, per_round=rounds, method=__doc__)
        if os.environ.get("OUT"):                                        # after every round: a call cut short keeps what it measured
            with open(os.path.join(os.environ["OUT"], "attention_host_ab.json"), "w") as f: json.dump(payload, f, indent=1)
    print(f"\n{'shape':9} {'Hopper kernels':15} {'before us':>9} {'after us':>9} {'cudnn us':>9}  after / before [95%]")
    for s, row in table.items():
        lo_hi = row["after_over_before"]
        kernels = row["hopper"]["after"] if row["hopper"]["after"] == row["hopper"]["before"] else "differ: " + "/".join(row["hopper"].values())
        print(f"{s:9} {kernels:15} {row['flash_us']['before']:9.1f} {row['flash_us']['after']:9.1f} "
              f"{row.get('cudnn_us', {}).get('after', float('nan')):9.1f}  %.3f [%s, %s]" %
              (lo_hi[0], *("%.3f" % x if x is not None else "-" for x in lo_hi[1:])))

def summary(rounds, ratio_interval):
    "Per shape: the Hopper kernels each tree took, median host us, after / before (and flash / cuDNN after) with 95% intervals."
    table = {}
    for s in rounds[0]["before"]:
        med = lambda label, arm: round(statistics.median(x[label][s][arm] for x in rounds), 1)
        row = dict(hopper={label: rounds[0][label][s]["hopper"] for label in ("before", "after")},
                   flash_us={label: med(label, "flash") for label in ("before", "after")},
                   after_over_before=ratio_interval([x["after"][s]["flash"] / x["before"][s]["flash"] for x in rounds]))
        if "cudnn" in rounds[0]["before"][s]:
            row["cudnn_us"] = {label: med(label, "cudnn") for label in ("before", "after")}
            row["flash_over_cudnn_after"] = ratio_interval([x["after"][s]["flash"] / x["after"][s]["cudnn"] for x in rounds])
        table[s] = row
    return table

if __name__ == "__main__":
    main()
