"""Can the cross-entropy kernel drop one of its three passes over the logits?

`matmul.cross_entropy_rows_kernel` runs one program per row of a 4096-row chunk of logits: it reads the row once for
its log-sum-exp, then reads it again and writes the gradient in its place. That is three passes over the row where the
roofline counts two (read the logits, write the gradient). On one H100 the three passes ran at 87% to 89% of the copy
ceiling (`experiments/results/profile_CONFIG_h100.json`: 2.40 ms at `rb100m`, 3.68 ms at `prof183m`), so only a pass
fewer can make it faster; at `prof183m` that is worth about 1.2 ms of a 39.6 ms step.

Variants, each checked against float64 (loss per row and gradient, with ignored rows) before it is timed:
- `package`: the kernel as it ships (BLOCK_V 2048, 8 warps, a program per row).
- `persistent P/SM BLOCK_V wW`: the same body in P programs per SM that walk the rows, so few rows are in flight and
  the second read of a row may still be in L2 (50 MB on an H100; a 50,432-column bf16 row is 100 KB).
- the same with L2 hints (the first read `evict_last`, the second `evict_first`), persistent or a program per row.
- `one read wW`: the whole padded row in registers (BLOCK_V = the next power of two of the padded vocabulary), read
  once, W warps a program. Compiled for sm_90 (`sm90_compile.py`, Triton 3.6): no spills at 32,768 columns with 32
  warps; 476 spilled bytes at 65,536 (`prof183m`'s 50,432 padded) with 32 warps, 2,922 with 16.
- `one read, 4 tiles wW`: the row as four power-of-two tiles that sum to the padded vocabulary or just above (36
  spilled bytes at `prof183m` with 32 warps, none at `rb100m`).

`python experiments/cross_entropy_variants.py` on a GPU (ROUNDS, default 5, alternated, median_ms per call); on a
CPU with TRITON_INTERPRET=1 it runs the checks at small shapes and skips the timing. Writes
$OUT/cross_entropy_variants.json when OUT is set. This is an experiment, not part of rtrainer."""
import json, os, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer import matmul as M
from rtrainer.matmul import row_logsumexp
from rtrainer.kernels import INTERPRETING, TOLERANCE, median_ms, ratio_interval, alternation, check_close, machine_metadata, _program_count

ROUNDS = int(os.environ.get("ROUNDS", 5))
IGNORE = -100
SHAPES = {"rb100m": (4096, 32004, 32064), "prof183m": (4096, 50257, 50432)}   # a chunk: rows, vocabulary, padded
CHECK_SHAPES = ((77, 1000, 1024), (5, 300, 320))                               # odd rows and vocabularies

@triton.jit
def ce_rows_persistent_kernel(logits_ptr, targets_ptr, row_loss_ptr, inv_count_ptr, n_rows, stride_row, vocab_size,
                              padded_vocab_size, ignore_index, BLOCK_V: tl.constexpr, FIRST: tl.constexpr, SECOND: tl.constexpr):
    """The package kernel's body (gradient written), in programs that walk rows pid, pid + programs, ...; FIRST and
    SECOND: the L2 eviction policy of the first and the second read ("" for none)."""
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        base = logits_ptr + tl.cast(row, tl.int64) * stride_row
        target = tl.load(targets_ptr + row)
        valid = target != ignore_index
        lse = row_logsumexp(base, vocab_size, BLOCK_V, FIRST)
        target_logit = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
        tl.store(row_loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        scale = tl.where(valid, tl.load(inv_count_ptr), 0.0)
        for start in range(0, padded_vocab_size, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf"), eviction_policy=SECOND).to(tl.float32)
            grad = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(base + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=cols < padded_vocab_size)

@triton.jit
def ce_rows_one_read_kernel(logits_ptr, targets_ptr, row_loss_ptr, inv_count_ptr, stride_row, vocab_size,
                            padded_vocab_size, ignore_index, BLOCK_V: tl.constexpr):
    "A program per row holding the whole padded row (BLOCK_V >= padded_vocab_size): one read, one write."
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    z = tl.load(base + cols, mask=cols < vocab_size, other=float("-inf"))               # kept as loaded (bf16)
    m = tl.max(z, 0).to(tl.float32)
    lse = m + tl.log(tl.sum(tl.exp(z.to(tl.float32) - m), 0))
    target_logit = tl.sum(tl.where(cols == target, z.to(tl.float32), 0.0), 0)
    tl.store(row_loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    scale = tl.where(valid, tl.load(inv_count_ptr), 0.0)
    grad = tl.exp(z.to(tl.float32) - lse) - tl.where(cols == target, 1.0, 0.0)
    tl.store(base + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=cols < padded_vocab_size)

@triton.jit
def ce_rows_tiles_kernel(logits_ptr, targets_ptr, row_loss_ptr, inv_count_ptr, stride_row, vocab_size, padded_vocab_size,
                         ignore_index, B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr):
    """The one-read kernel with the row held as four tiles of B0..B3 columns (powers of two, summing to at least the
    padded vocabulary), so a row of 50,432 columns takes 51,200 values instead of 65,536."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    c0 = tl.arange(0, B0)
    c1 = B0 + tl.arange(0, B1)
    c2 = B0 + B1 + tl.arange(0, B2)
    c3 = B0 + B1 + B2 + tl.arange(0, B3)
    z0 = tl.load(base + c0, mask=c0 < vocab_size, other=float("-inf"))
    z1 = tl.load(base + c1, mask=c1 < vocab_size, other=float("-inf"))
    z2 = tl.load(base + c2, mask=c2 < vocab_size, other=float("-inf"))
    z3 = tl.load(base + c3, mask=c3 < vocab_size, other=float("-inf"))
    m = tl.maximum(tl.maximum(tl.max(z0, 0), tl.max(z1, 0)), tl.maximum(tl.max(z2, 0), tl.max(z3, 0))).to(tl.float32)
    total = (tl.sum(tl.exp(z0.to(tl.float32) - m), 0) + tl.sum(tl.exp(z1.to(tl.float32) - m), 0)
             + tl.sum(tl.exp(z2.to(tl.float32) - m), 0) + tl.sum(tl.exp(z3.to(tl.float32) - m), 0))
    lse = m + tl.log(total)
    target_logit = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)            # just read: from L1 or L2
    tl.store(row_loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
    scale = tl.where(valid, tl.load(inv_count_ptr), 0.0)
    out = logits_ptr.dtype.element_ty
    tl.store(base + c0, ((tl.exp(z0.to(tl.float32) - lse) - tl.where(c0 == target, 1.0, 0.0)) * scale).to(out), mask=c0 < padded_vocab_size)
    tl.store(base + c1, ((tl.exp(z1.to(tl.float32) - lse) - tl.where(c1 == target, 1.0, 0.0)) * scale).to(out), mask=c1 < padded_vocab_size)
    tl.store(base + c2, ((tl.exp(z2.to(tl.float32) - lse) - tl.where(c2 == target, 1.0, 0.0)) * scale).to(out), mask=c2 < padded_vocab_size)
    tl.store(base + c3, ((tl.exp(z3.to(tl.float32) - lse) - tl.where(c3 == target, 1.0, 0.0)) * scale).to(out), mask=c3 < padded_vocab_size)

def four_tiles(n):
    "Four powers of two, largest first, whose sum is the least such sum of at least n (for ce_rows_tiles_kernel)."
    tiles, left = [], n
    for i in range(4):
        if i == 3: tiles.append(triton.next_power_of_2(max(left, 1))); break
        t = 1 << max(left.bit_length() - 1, 0) if left > 0 else 1                    # the largest power of two in what is left
        tiles.append(t); left -= t
    return tuple(sorted(tiles, reverse=True))

def variants():
    "name -> fn(logits, targets, row_loss, inv_count, vocab_size): the gradient written into logits in place."
    def package(logits, targets, row_loss, inv_count, V):
        M.cross_entropy_rows(logits, targets, row_loss, inv_count, V, IGNORE, True)
    def persistent(per_sm, block, warps, first="", second=""):
        def run(logits, targets, row_loss, inv_count, V):
            programs = _program_count(logits.shape[0], per_sm, logits.device)
            ce_rows_persistent_kernel[(programs,)](logits, targets, row_loss, inv_count, logits.shape[0], logits.stride(0), V,
                                                   logits.shape[1], IGNORE, BLOCK_V=block, FIRST=first, SECOND=second, num_warps=warps)
        return run
    def one_read(warps):
        def run(logits, targets, row_loss, inv_count, V):
            ce_rows_one_read_kernel[(logits.shape[0],)](logits, targets, row_loss, inv_count, logits.stride(0), V, logits.shape[1],
                                                        IGNORE, BLOCK_V=triton.next_power_of_2(logits.shape[1]), num_warps=warps)
        return run
    out = {"package": package}
    for per_sm, block, warps in ((1, 8192, 16), (2, 4096, 8), (2, 8192, 8), (4, 2048, 8)):
        out[f"persistent {per_sm}/SM {block} w{warps}"] = persistent(per_sm, block, warps)
    out["persistent 2/SM 8192 w8 L2 hints"] = persistent(2, 8192, 8, "evict_last", "evict_first")
    out["per row 2048 w8 L2 hints"] = persistent(1 << 20, 2048, 8, "evict_last", "evict_first")   # a program per row, as the package
    def tiles(warps):
        def run(logits, targets, row_loss, inv_count, V):
            b = four_tiles(logits.shape[1])
            ce_rows_tiles_kernel[(logits.shape[0],)](logits, targets, row_loss, inv_count, logits.stride(0), V, logits.shape[1],
                                                     IGNORE, B0=b[0], B1=b[1], B2=b[2], B3=b[3], num_warps=warps)
        return run
    for warps in (16, 32):
        out[f"one read w{warps}"] = one_read(warps)
        out[f"one read, 4 tiles w{warps}"] = tiles(warps)
    return out

def inputs(rows, V, VP, device, seed=0):
    "bf16 logits (rows, VP) with a spread like a trained head's, targets with a few ignored rows, 1 / the kept count."
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = (torch.randn(rows, VP, generator=g) * 3).to(torch.bfloat16).to(device)
    targets = torch.randint(0, V, (rows,), generator=g)
    targets[::7] = IGNORE
    targets = targets.to(device)
    inv_count = (1.0 / (targets != IGNORE).sum().float()).reshape(1)
    return logits, targets, inv_count

def check(name, fn, rows, V, VP, device):
    "Relative errors of the loss rows and the gradient against float64 (the gradient is bf16: 2^-8 relative)."
    logits, targets, inv_count = inputs(rows, V, VP, device, seed=rows)
    ref_logits, ref_loss = logits.double().cpu(), torch.empty(rows, dtype=torch.float64)
    M.cross_entropy_rows_torch(ref_logits, targets.cpu(), ref_loss, inv_count.double().cpu(), V, IGNORE, True)
    row_loss = torch.full((rows,), float("nan"), device=device)
    fn(logits, targets, row_loss, inv_count, V)
    where = f"{name} at {rows}x{V}"
    return (check_close(f"{where}, loss", row_loss, ref_loss, TOLERANCE[torch.float32]),
            check_close(f"{where}, gradient", logits, ref_logits, TOLERANCE[torch.bfloat16]))

def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not INTERPRETING: sys.exit("needs a GPU, or TRITON_INTERPRET=1 for the checks alone")
    arms = variants()
    errors = {name: [check(name, fn, *shape, device) for shape in CHECK_SHAPES] for name, fn in arms.items()}
    for name, errs in errors.items(): print(f"{name:28s} checked: loss {max(e[0] for e in errs):.1e}, gradient {max(e[1] for e in errs):.1e}")
    if device == "cpu": return
    rows_out = []
    for shape_name, (rows, V, VP) in SHAPES.items():
        logits, targets, inv_count = inputs(rows, V, VP, device)
        errors[shape_name] = {name: check(name, fn, 256, V, VP, device) for name, fn in arms.items()}
        row_loss = torch.empty(rows, device=device)
        times = {name: [] for name in arms}
        for r in range(ROUNDS):
            for name in alternation(arms, r):
                fn = arms[name]
                times[name].append(median_ms(lambda: fn(logits, targets, row_loss, inv_count, V)))
        two_passes = rows * (V + VP) * 2                                     # read the logits, write the gradient
        for name, ms in times.items():
            ratio = ratio_interval([p / t for p, t in zip(times["package"], ms)])
            rows_out.append(dict(shape=shape_name, rows=rows, vocab=V, padded=VP, variant=name, ms=min(ms), ms_rounds=ms,
                                 two_pass_GBps=two_passes / min(ms) / 1e6, speedup_over_package=ratio))
    payload = dict(**machine_metadata(), rounds=ROUNDS, rows=rows_out, checks=errors,
                   method="median_ms per call, variants alternated over rounds; speedup = package ms / variant ms, 95% interval")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "cross_entropy_variants.json"), "w") as f: json.dump(payload, f, indent=1)
    print(f"\n{'shape':9s} {'variant':28s} {'ms':>7s} {'GB/s (2 passes)':>16s}  speedup over package [95%]")
    for r in rows_out:
        g, lo, hi = r["speedup_over_package"]
        print(f"{r['shape']:9s} {r['variant']:28s} {r['ms']:7.3f} {r['two_pass_GBps']:16.0f}  {g:.3f}"
              + (f" [{lo:.3f}, {hi:.3f}]" if lo else ""))

if __name__ == "__main__":
    main()
