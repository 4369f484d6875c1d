"""Paired check of the two forward tiles at long sequences, timed the way the attention benchmark times them.

The sixth round's sweep (kernel alone, paired) had the 128 x 64, 8-warp, 128-register forward tile 3% faster than
the 64 x 64, 4-warp tile at T 4096 and 8192 (head dim 64), but the benchmark that followed measured the forward at
396 and 422 TFLOP/s against the previous session's 410 and 429 on the 64 x 64 tile: a comparison across two machine
sessions. Here both tiles run in one process, through `flash_attention` as the benchmark's forward does, alternating
over ROUNDS rounds, with a 95% interval on the paired ratio. Outputs of the two tiles are checked against each other.

`python experiments/attention_long_forward.py` on a GPU; writes $OUT/attention_long_forward.json when OUT is set."""
import json, os, time
import torch
import triton
import rtrainer.attention as A
from rtrainer.kernels import median_ms, ratio_interval, alternation

ROUNDS = 6
LENGTHS = (2048, 4096, 8192)
TILES = {"64x64 w4 s3": (64, 64, 4, 3, None), "128x64 w8 s3 r128": (128, 64, 8, 3, 128)}

def main():
    H, KV, hd = A.SWEEP_HEADS
    rows = []
    for T in LENGTHS:
        B = max(1, A.SWEEP_TOKENS // T)
        q, k, v = A.fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
        outs, times = {}, {name: [] for name in TILES}
        def forward(tile):
            A.TUNED_CONFIGS["forward"][(64, "long" if T >= A.LONG_SEQUENCE else "short")] = tile
            return A.flash_attention(q, k, v)
        saved = dict(A.TUNED_CONFIGS["forward"])
        try:
            for name, tile in TILES.items(): outs[name] = forward(tile).float()          # compile, and the outputs
            diff = (outs["64x64 w4 s3"] - outs["128x64 w8 s3 r128"]).abs().max().item()
            for r in range(ROUNDS):
                for name in alternation(TILES, r):
                    tile = TILES[name]
                    times[name].append(median_ms(lambda: forward(tile)))
        finally:
            A.TUNED_CONFIGS["forward"].clear(); A.TUNED_CONFIGS["forward"].update(saved)
        flops = A.attention_flops(B, H, T, hd)
        ratios = [a / b for a, b in zip(times["64x64 w4 s3"], times["128x64 w8 s3 r128"])]   # > 1: the 128 x 64 tile is faster
        mean, low, high = ratio_interval(ratios)
        row = dict(T=T, B=B, H=H, KV=KV, hd=hd, max_abs_diff=diff,
                   **{f"{n} ms": sorted(t)[len(t) // 2] for n, t in times.items()},
                   **{f"{n} TFLOP/s": flops / (sorted(t)[len(t) // 2]) / 1e9 for n, t in times.items()},
                   speedup_128x64=mean, ci95_low=low, ci95_high=high, ratios=ratios)
        rows.append(row)
        print(f"T {T:5d}: 64x64 {row['64x64 w4 s3 TFLOP/s']:.1f}, 128x64 {row['128x64 w8 s3 r128 TFLOP/s']:.1f} TFLOP/s, "
              f"128x64 speed {mean:.3f} [{low:.3f}, {high:.3f}], max |diff| {diff:.1e}", flush=True)
    result = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, rounds=ROUNDS, tiles=TILES, rows=rows,
                  method="flash_attention forward (the autograd function, as benchmark_suite times it), median_ms per arm, arms alternated")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_long_forward.json"), "w") as f: json.dump(result, f, indent=1)

if __name__ == "__main__":
    main()
