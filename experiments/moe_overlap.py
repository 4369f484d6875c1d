"""Can a bandwidth-bound pass hide under a power-bound expert GEMM? The moe4b gate_up product with its SwiGLU (03a's
Gluon kernel, 8 experts x 4,096 rows, D 3072, 2FF 8192) is power-bound at the H200's 700 W limit; a copy is
bandwidth-bound. Here the GEMM runs on all multiprocessors but S (its persistent grid capped at SMS - S) while a
copy of COPY_GIB in and out runs on a second stream with S x CTAS_PER_SM programs, against the two one after the
other at full width. Arms alternate over ROUNDS rounds (median_ms each): the GEMM alone at full and capped width,
the copy alone at full width and on S multiprocessors' worth of programs, the pair in sequence, the pair overlapped.
Run on the GPU: `python experiments/moe_overlap.py` (writes $OUT/moe_overlap.json when OUT is set)."""
import json, os, sys, time
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer import moe_hopper
from rtrainer.kernels import median_ms, alternation, ratio_interval

ROUNDS = int(os.environ.get("ROUNDS", 5))
SPARE = [int(s) for s in os.environ.get("SPARE", "8,16,24").split(",")]   # multiprocessors left to the copy
CTAS_PER_SM = int(os.environ.get("CTAS_PER_SM", 4))
COPY_GIB = float(os.environ.get("COPY_GIB", 0.75))
E, C, D, N2 = 8, 4096, 3072, 8192

@triton.jit
def stream_copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    "dst[:n] = src[:n] with a persistent grid: the program count sets how many multiprocessors the copy takes."
    start = tl.program_id(0) * BLOCK
    for base in range(start, n, tl.num_programs(0) * BLOCK):
        offs = base + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    rows = torch.randn(E * C, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, D, N2, device="cuda", dtype=torch.bfloat16) * 0.02
    n = int(COPY_GIB * 2**30) // 2
    src, dst = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    full_sm_count = moe_hopper._sm_count

    def gemm(width):
        moe_hopper._sm_count = lambda index: width                    # the kernel's persistent grid: min(tiles, this)
        try: moe_hopper.hopper_grouped_gemm(rows, w, swiglu=True)
        finally: moe_hopper._sm_count = full_sm_count
    def copy(programs): stream_copy_kernel[(programs,)](src, dst, n, BLOCK=16384, num_warps=8)
    def overlapped(spare):
        main_stream = torch.cuda.current_stream()
        side.wait_stream(main_stream)
        gemm(sms - spare)                                                 # first: its CTAs take their SMs whole
        with torch.cuda.stream(side): copy(spare * CTAS_PER_SM)          # then the copy's fill the spare ones
        main_stream.wait_stream(side)

    arms = {"GEMM, all SMs": lambda: gemm(sms), "copy, all SMs": lambda: copy(sms * CTAS_PER_SM),
            "GEMM then copy, all SMs": lambda: (gemm(sms), copy(sms * CTAS_PER_SM))}
    for s in SPARE:
        arms[f"GEMM on {sms - s} SMs"] = lambda s=s: gemm(sms - s)
        arms[f"copy on {s} SMs' programs"] = lambda s=s: copy(s * CTAS_PER_SM)
        arms[f"overlapped, copy on {s} SMs"] = lambda s=s: overlapped(s)
    for fn in arms.values(): fn()
    torch.cuda.synchronize()
    if not torch.equal(src, dst): raise SystemExit("moe_overlap: the copy is wrong")
    times = {name: [] for name in arms}
    for r in range(ROUNDS):
        for name in alternation(arms, r): times[name].append(median_ms(arms[name]))
        print(f"round {r}: " + ", ".join(f"{times[k][-1]:.3f}" for k in arms), flush=True)
    base = times["GEMM then copy, all SMs"]
    rows_out = []
    for name, ts in times.items():
        ratio, lo, hi = ratio_interval([b / t for b, t in zip(base, ts)])
        rows_out.append(dict(arm=name, ms=sum(ts) / len(ts), ms_min=min(ts), ms_max=max(ts), speed_vs_sequence=ratio, ci95=[lo, hi]))
    copy_bytes = 2 * n * 2
    print(f"\ncopy: {copy_bytes / 2**30:.2f} GiB moved; {sms} SMs, {CTAS_PER_SM} copy programs per spare SM")
    print(f"{'arm':32s} {'ms':>7s} {'GB/s (copies)':>13s} {'vs GEMM then copy':>24s}")
    for row in rows_out:
        bw = f"{copy_bytes / row['ms'] / 1e6:.0f}" if row["arm"].startswith("copy") else ""
        lo, hi = row["ci95"]
        ci = f"{row['speed_vs_sequence']:.3f} [{lo:.3f}, {hi:.3f}]" if lo is not None else f"{row['speed_vs_sequence']:.3f}"
        print(f"{row['arm']:32s} {row['ms']:7.3f} {bw:>13s} {ci:>24s}")
    if os.environ.get("OUT"):
        payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, sms=sms, ctas_per_spare_sm=CTAS_PER_SM, copy_bytes=copy_bytes,
                       gemm=dict(experts=E, rows_per_expert=C, d_model=D, n=N2, swiglu=True), rounds=ROUNDS, rows=rows_out,
                       method=__doc__.split("\n")[0])
        with open(os.path.join(os.environ["OUT"], "moe_overlap.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if not torch.cuda.is_available(): sys.exit("moe_overlap: needs a CUDA GPU")
    main()
