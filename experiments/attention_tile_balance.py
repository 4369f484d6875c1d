"""How evenly the persistent Hopper attention kernels spread their work over the SMs, by arithmetic (runs on a CPU).

Why: in L2-sized sections of heads (rtrainer.attention_hopper.SECTION_BYTES) the forward and dQ ran 1.2x to 1.35x
faster on an H100 and the dK/dV 0.8x slower with grouped heads (attention_ws, round 14). Each program takes every
P-th tile of the order (P = the GPU's SMs), so which tiles a program gets, heavy or light, depends on how the order
lines up with P. This script counts it: a tile's work is the number of key blocks it visits (forward, dQ: its query
pair's position; dK/dV: the query blocks after its key pair), in units of a 128-row block, and the balance of an order
is the mean program's work over the busiest program's, the fraction of the kernel's time that SMs are busy if every
tile runs at the same speed. Orders compared: the package's (each program every P-th tile), and the same order given
out one tile at a time to whichever program is free first (what a tile counter in the kernel would do), and a table
order built on the host (each program still takes as many tiles as strided, but each round of P tiles goes heaviest
first to the least loaded programs: what a tile table the kernel reads would do); and, for each section size, the width
up to it that balances best under the strided order.

`python experiments/attention_tile_balance.py` prints a table and writes experiments/results/attention_tile_balance.json.
This is an experiment, not part of rtrainer."""
import heapq, json, math, os, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_configs import shape_dims
from rtrainer import attention_hopper as hopper

PROGRAMS = 132                 # SMs of an H100 SXM or H200
PAIR_ROWS = 128                # rows of a tile: two consumers' 64
SHAPES = ("rb100m", "prof183m", "dense1b", "moe4b", "h128T2048", "T4096", "T8192", "h128T4096", "h128T8192")
SECTIONS_MB = (0, 8, 24, 48)

def tile_pairs(n_pairs, heads, section):
    "Pair index (0: most work) of every tile, in the kernels' order: sections of `section` heads, pair by pair within one."
    pairs = []
    for t in range(n_pairs * heads):
        first = t // (n_pairs * section) * section
        width = min(section, heads - first)
        pairs.append((t - first * n_pairs) // width)
    return pairs

def work(n_pairs, pair):
    "Key blocks (forward, dQ) or query blocks (dK/dV) of a tile, in 128-row blocks; the diagonal block counts half."
    return n_pairs - pair - 0.5

def strided_balance(pairs, n_pairs, programs=PROGRAMS):
    "Mean over busiest program's work when program p takes tiles p, p + programs, ..."
    load = [0.0] * programs
    for t, pair in enumerate(pairs): load[t % programs] += work(n_pairs, pair)
    return sum(load) / programs / max(load)

def greedy_balance(pairs, n_pairs, programs=PROGRAMS):
    "The same, each tile in order to the program that is free first."
    free = [(0.0, p) for p in range(programs)]
    for pair in pairs:
        busy, p = heapq.heappop(free)
        heapq.heappush(free, (busy + work(n_pairs, pair), p))
    done = [busy for busy, _ in free]
    return sum(done) / programs / max(done)

def table_balance(pairs, n_pairs, programs=PROGRAMS):
    "The same, in rounds of `programs` tiles: each round's tiles, heaviest first, to the least loaded programs so far."
    load = [0.0] * programs
    for r in range(0, len(pairs), programs):
        tiles = sorted((work(n_pairs, pair) for pair in pairs[r:r + programs]), reverse=True)
        for w, p in zip(tiles, sorted(range(programs), key=load.__getitem__)): load[p] += w
    return sum(load) / programs / max(load)

def best_width(n_pairs, heads, widest, whole):
    "(width, strided balance) of the best balanced section width, whole groups up to `widest` (the widest of equals)."
    return max(((round(strided_balance(tile_pairs(n_pairs, heads, w), n_pairs), 3), w) for w in range(whole, widest + 1, whole)))[::-1]

def balance_rows():
    rows = []
    for name in SHAPES:
        B, H, KV, T, hd = shape_dims(name)
        group, n_pairs = H // KV, math.ceil(T / PAIR_ROWS)
        for kind, heads, whole in (("forward", B * H, group), ("dkdv", B * KV, 1)):
            for mb in SECTIONS_MB:
                hopper.SECTION_BYTES[kind] = mb << 20                      # the package's width for this size
                hopper.BALANCED_SECTIONS = False                                 # the widest, as measured in round 14
                section = hopper.section_heads(kind, B, T, H, KV, hd, n_pairs, PROGRAMS)
                pairs = tile_pairs(n_pairs, heads, section)
                rows.append(dict(shape=name, kernel=kind, section_mb=mb, section_heads=section, heads=heads, tiles=len(pairs),
                                 strided=strided_balance(pairs, n_pairs), greedy=greedy_balance(pairs, n_pairs),
                                 table=table_balance(pairs, n_pairs)))
                if mb: rows[-1]["best_width"], rows[-1]["best_width_strided"] = best_width(n_pairs, heads, section, whole)
    return rows

if __name__ == "__main__":
    package_sections = dict(hopper.SECTION_BYTES)
    rows = balance_rows()
    hopper.SECTION_BYTES.update(package_sections)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_tile_balance.json")
    with open(out, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), commit=commit, programs=PROGRAMS, package_section_bytes=package_sections,
                       method=__doc__.split("\n\n")[1], rows=rows), f, indent=1)
    print(f"{'shape':10} {'kernel':8} {'MB':>3} {'heads':>11} {'tiles':>5} {'strided':>8} {'greedy':>7} {'table':>6}  best balanced width")
    for r in rows:
        best = f"  {r['best_width']:4} heads {r['best_width_strided']:.3f}" if r["section_mb"] else ""
        print(f"{r['shape']:10} {r['kernel']:8} {r['section_mb']:3} {r['section_heads']:>4} of {r['heads']:<4} {r['tiles']:5} "
              f"{r['strided']:8.3f} {r['greedy']:7.3f} {r['table']:6.3f}{best}")
