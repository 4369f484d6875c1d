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
`--calibrate`: how well the arithmetic predicted the measured speed. For each pair of arms of the recorded H100 rounds
whose plans differ (attention_ws round 15: the widest against balanced widths; round 17: balanced widths against the
tables of `_plan`), the package's plan under each arm's settings, its balance, and the predicted speed-up (the balances'
ratio) beside the measured one (the arms' median times); writes experiments/results/attention_tile_balance_calibration.json.
This is an experiment, not part of rtrainer."""
import heapq, json, math, os, statistics, subprocess, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_configs import shape_dims
from rtrainer import attention_hopper as hopper

PROGRAMS = 132                 # SMs of an H100 SXM or H200
PAIR_ROWS = 128                # rows of a tile: two consumers' 64
SHAPES = ("rb100m", "prof183m", "dense1b", "moe4b", "h128T2048", "T4096", "T8192", "h128T4096", "h128T8192")
SECTIONS_MB = (0, 8, 24, 48)

def greedy_balance(n_pairs, heads, section, programs=PROGRAMS):
    "Mean over the busiest program's work when each tile of the order goes to the program that is free first."
    free = [(0.0, p) for p in range(programs)]
    for work in hopper._tile_work(n_pairs, heads, section).tolist():
        busy, p = heapq.heappop(free)
        heapq.heappush(free, (busy + work, p))
    done = [busy for busy, _ in free]
    return sum(done) / programs / max(done)

def best_width(n_pairs, heads, widest, whole):
    "(width, strided balance) of the best balanced section width, whole groups up to `widest` (the widest of equals)."
    return max(((round(hopper.tile_balance(n_pairs, heads, w, PROGRAMS), 3), w) for w in range(whole, widest + 1, whole)))[::-1]

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
                table = hopper.tile_table(n_pairs, heads, section, PROGRAMS)
                rows.append(dict(shape=name, kernel=kind, section_mb=mb, section_heads=section, heads=heads, tiles=n_pairs * heads,
                                 strided=hopper.tile_balance(n_pairs, heads, section, PROGRAMS),
                                 greedy=greedy_balance(n_pairs, heads, section),
                                 table=hopper.tile_balance(n_pairs, heads, section, PROGRAMS, table)))
                if mb: rows[-1]["best_width"], rows[-1]["best_width_strided"] = best_width(n_pairs, heads, section, whole)
    return rows

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# file: (before, after). Round 16 (attention_ws_h100_table.json, s24b -> s24bt) ran the plan before `_plan`, tables for
# dK/dV only at the widest width, which the package no longer computes: its pairs stay in the record made before
# `_plan` (the git history of the calibration JSON).
ROUNDS = {"attention_ws_h100_balanced.json": ("s24", "s24b"), "attention_ws_h100_tables17.json": ("s24b", "s24bt"),
          "attention_ws_h100_tables17_hd64.json": ("s24b", "s24bt")}

def planned_balance(kind, B, H, KV, T, hd, arm):
    """(balance, section width, table?) of the package's plan for `kind` under an attention_ws arm's settings ("s24":
    24 MB, "b" balanced widths, "t" tile tables, as attention_ws.py sets them), at 132 programs."""
    setting = arm[1:]
    hopper.SECTION_BYTES[kind] = int(setting.rstrip("bt")) << 20
    hopper.BALANCED_SECTIONS, hopper.TILE_TABLE = "b" in setting, dict.fromkeys(hopper.TILE_TABLE, "t" in setting)
    block = dict(forward=hopper.FORWARD_TILES, dq=hopper.DQ_TILES, dkdv=hopper.DKDV_TILES)[kind][hd][0]
    n_pairs = math.ceil(T / (2 * block))
    heads = B * KV if kind == "dkdv" else B * H
    programs = min(n_pairs * heads, PROGRAMS)
    width, table = hopper._plan(kind, B, T, H, KV, hd, n_pairs, programs, "cpu")
    return hopper.tile_balance(n_pairs, heads, width, programs, table), width, table is not None

def calibration_rows():
    "Predicted against measured speed-ups for every recorded pair of arms whose plans differ."
    rows = []
    for name, (before, after) in ROUNDS.items():
        with open(os.path.join(RESULTS, name)) as f: result = json.load(f)
        for r in result["rows"]:
            arms = {a.split()[-1]: a for a in r["ms"] if a.startswith("ws ")}   # the package's tile: one arm per setting
            if before not in arms or after not in arms: continue
            dims = shape_dims(r["shape"])
            (b0, w0, t0), (b1, w1, t1) = (planned_balance(r["kernel"], *dims, arm) for arm in (before, after))
            if (w0, t0) == (w1, t1): continue
            rows.append(dict(round=name, shape=r["shape"], kernel=r["kernel"], arms=[before, after], widths=[w0, w1], tables=[t0, t1],
                             balance=[b0, b1], predicted=b1 / b0, measured=r["ms"][arms[before]] / r["ms"][arms[after]]))
    return rows

def calibrate():
    kept = dict(hopper.SECTION_BYTES), hopper.BALANCED_SECTIONS, dict(hopper.TILE_TABLE)
    rows = calibration_rows()
    hopper.SECTION_BYTES.update(kept[0]); hopper.BALANCED_SECTIONS, hopper.TILE_TABLE = kept[1:]
    errors = sorted(r["measured"] / r["predicted"] for r in rows)
    summary = dict(pairs=len(rows), within_5pct=sum(abs(e - 1) <= 0.05 for e in errors), median_measured_over_predicted=statistics.median(errors),
                   worst=[min(errors), max(errors)])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(os.path.join(RESULTS, "attention_tile_balance_calibration.json"), "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), commit=commit, programs=PROGRAMS, method=__doc__.split("\n\n")[2],
                       summary=summary, rows=rows), f, indent=1)
    print(f"{'shape':10} {'kernel':8} {'arms':12} {'width':>9} {'table':>5} {'balance':>13} {'predicted':>9} {'measured':>8}")
    for r in rows:
        print(f"{r['shape']:10} {r['kernel']:8} {'->'.join(r['arms']):12} {r['widths'][0]:>4}->{r['widths'][1]:<4} {'yes' if r['tables'][1] else 'no':>5} "
              f"{r['balance'][0]:.3f}->{r['balance'][1]:.3f} {r['predicted']:9.3f} {r['measured']:8.3f}")
    print(f"{summary['within_5pct']} of {summary['pairs']} within 5% of the prediction; measured / predicted median "
          f"{summary['median_measured_over_predicted']:.3f}, from {summary['worst'][0]:.3f} to {summary['worst'][1]:.3f}")

if __name__ == "__main__" and "--calibrate" in sys.argv:
    calibrate()
elif __name__ == "__main__":
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
