"""Why do four single-pass forwards (vecadd, SwiGLU, RMSNorm at 8192 columns, the embedding) trail torch.compile's
kernels by 1-3%? One GPU run: dump what inductor generates for each, time rtrainer's kernel against it and against
variants that copy one of its traits at a time (flat int32 indexing, its block and warps, streaming cache hints).
`python experiments/forward_variants.py` on a GPU; writes $OUT/forward_variants.json and $OUT/inductor_forward_code.txt."""
import json, os, time
import torch, triton, triton.language as tl
from torch._inductor.utils import run_and_get_code
from rtrainer import kernels as K

@triton.jit
def vecadd_flat_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, HINTS: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)          # int32 offsets, as inductor uses below 2^31
    mask = offsets < n
    if HINTS:                                                         # streamed once: no reason to keep it in L2
        a = tl.load(a_ptr + offsets, mask=mask, eviction_policy="evict_first")
        b = tl.load(b_ptr + offsets, mask=mask, eviction_policy="evict_first")
    else:
        a, b = tl.load(a_ptr + offsets, mask=mask), tl.load(b_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, (a.to(tl.float32) + b.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=".cs" if HINTS else "")

@triton.jit
def swiglu_flat_kernel(gate_up_ptr, out_ptr, n, ff, BLOCK: tl.constexpr, HINTS: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)              # flat index over (rows, FF), int32
    mask = idx < n
    row, col = idx // ff, idx % ff
    src = gate_up_ptr + row * (2 * ff) + col
    if HINTS:
        gate = tl.load(src, mask=mask, eviction_policy="evict_first").to(tl.float32)
        up = tl.load(src + ff, mask=mask, eviction_policy="evict_first").to(tl.float32)
    else:
        gate, up = tl.load(src, mask=mask).to(tl.float32), tl.load(src + ff, mask=mask).to(tl.float32)
    tl.store(out_ptr + idx, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask,
             cache_modifier=".cs" if HINTS else "")

def main():
    out_dir = os.environ.get("OUT", "/tmp"); t_start = time.time()
    dev, bf16 = "cuda", torch.bfloat16
    n = 2 ** 28
    a, b, o = (torch.randn(n, device=dev, dtype=bf16) for _ in range(3))
    gu = torch.randn(65536, 2 * 8192, device=dev, dtype=bf16); so = torch.empty(65536, 8192, device=dev, dtype=bf16)
    x = torch.randn(65536, 8192, device=dev, dtype=bf16); w = torch.rand(8192, device=dev) + 0.5
    ids = torch.randint(0, 50432, (65536,), device=dev); table = torch.randn(50432, 3072, device=dev, dtype=bf16)
    refs = {"vecadd": (lambda p, q: p + q, (a, b)), "swiglu": (K.swiglu_reference, (gu,)),
            "rms_norm": (K.rms_norm_reference, (x, w)), "embedding": (K.embedding_reference, (ids, table))}
    compiled, code = {}, []
    for name, (fn, args) in refs.items():
        compiled[name] = torch.compile(fn, dynamic=False)
        with torch.no_grad(): _, srcs = run_and_get_code(compiled[name], *args)
        code.append(f"===== {name}\n" + "\n".join(srcs))
    open(os.path.join(out_dir, "inductor_forward_code.txt"), "w").write("\n".join(code))
    nbytes = {"vecadd": 3 * n * 2, "swiglu": 3 * 65536 * 8192 * 2, "rms_norm": 2 * 65536 * 8192 * 2, "embedding": 2 * 65536 * 3072 * 2}
    arms = {
        "vecadd": {"rtrainer": lambda: K.vecadd(a, b, out=o),
                   "flat int32 4096/8w": lambda: vecadd_flat_kernel[(triton.cdiv(n, 4096),)](a, b, o, n, BLOCK=4096, HINTS=False, num_warps=8),
                   "flat int32 1024/4w": lambda: vecadd_flat_kernel[(triton.cdiv(n, 1024),)](a, b, o, n, BLOCK=1024, HINTS=False, num_warps=4),
                   "flat int32 4096/8w, hints": lambda: vecadd_flat_kernel[(triton.cdiv(n, 4096),)](a, b, o, n, BLOCK=4096, HINTS=True, num_warps=8),
                   "compile": lambda: compiled["vecadd"](a, b)},
        "swiglu": {"rtrainer": lambda: K.swiglu_forward(gu, out=so),
                   "flat int32 1024/4w": lambda: swiglu_flat_kernel[(triton.cdiv(so.numel(), 1024),)](gu, so, so.numel(), 8192, BLOCK=1024, HINTS=False, num_warps=4),
                   "flat int32 2048/8w": lambda: swiglu_flat_kernel[(triton.cdiv(so.numel(), 2048),)](gu, so, so.numel(), 8192, BLOCK=2048, HINTS=False, num_warps=8),
                   "flat int32 1024/4w, hints": lambda: swiglu_flat_kernel[(triton.cdiv(so.numel(), 1024),)](gu, so, so.numel(), 8192, BLOCK=1024, HINTS=True, num_warps=4),
                   "compile": lambda: compiled["swiglu"](gu)},
        "rms_norm": {"rtrainer": lambda: K.rms_norm_forward(x, w), "compile": lambda: compiled["rms_norm"](x, w)},
        "embedding": {"rtrainer": lambda: K.embedding_forward(ids, table), "compile": lambda: compiled["embedding"](ids, table)},
    }
    check = {"vecadd": lambda: (o.float() - (a.float() + b.float())).abs().max().item() < 0.1,
             "swiglu": lambda: torch.allclose(so.float(), K.swiglu_reference(gu).float(), atol=0.05, rtol=0.02)}
    rows = []
    with torch.no_grad():
        for kernel, variants in arms.items():
            times = {v: [] for v in variants}
            try:
                for rnd in range(3):
                    for v in K.alternation(list(variants), rnd):
                        times[v].append(K.median_ms(variants[v]))
                        if kernel in check and v != "compile": assert check[kernel](), (kernel, v)
            except Exception as e:                                   # one kernel's failure must not cost the others
                print(f"{kernel}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"); continue
            base = times["compile"]
            for v, ts in times.items():
                mid, lo, hi = K.ratio_interval([c / t for c, t in zip(base, ts)])
                ms = sorted(ts)[1]
                rows.append(dict(kernel=kernel, variant=v, ms=ms, GBps=nbytes[kernel] / ms / 1e6, pct_copy=100 * nbytes[kernel] / ms / 1e6 / K.COPY_CEILING_GBPS,
                                 vs_compile=mid, ci95=(lo, hi)))
            torch.cuda.empty_cache()
    K.print_table([{k: (f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]" if k == "ci95" and r["ci95"][0] else v) for k, v in r.items()} for r in rows])
    json.dump(dict(K.machine_metadata(), rows=rows, seconds=time.time() - t_start), open(os.path.join(out_dir, "forward_variants.json"), "w"), indent=1, default=str)

if __name__ == "__main__": main()
