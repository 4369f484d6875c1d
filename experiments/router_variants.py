"""Candidate Triton kernels for the MoE router (drop-in for rtrainer.moe.route_tokens_triton / router_logits_triton /
router_weight_grad_triton), checked against float64 and timed against the current kernels.

    TRITON_INTERPRET=1 python router_variants.py --check     # CPU: every variant vs float64 on small odd shapes
    python router_variants.py                                # CUDA: verify at N=16384, D=3072, E=8, k=2, then time

Both kernels keep full fp32 (IEEE) arithmetic on the FMA units: no tl.dot, no tensor cores, no tf32. Instead of a
padded fp32 tl.dot, each thread keeps fp32 partial sums for its own few columns of x in registers and every product
is an FFMA: the cross-thread reduction (over the columns, for the logits) happens once per program, not per chunk.
Layouts are steered only through tensor shapes (what Triton's coalescing pass sees), never by hand.

`route_rowdot` / `logits_rowdot`: x tile (NC, G, R, 4): a lane owns 4 adjacent columns (an 8-byte bf16 load) of
R rows; NC lanes across the columns, the other 32/NC lanes and the warps across G row groups. The router is read
transposed, (E, D) fp32: one 16-byte load per expert per lane per chunk, in the same layout as x, so no layout
conversion in the loop; per chunk and thread 4*R*E FFMAs. One explicit accumulator per expert (E <= 8).

`grad_w_rowdot`: dW = x^T @ dlogits. x tile (32, W, R, 8): a lane owns 8 adjacent columns (a 16-byte load) of R rows,
32 lanes x 8 = 256 columns per program, the W warps split the rows; dlogits are loaded as (32, W, R, 8) too (each
lane the same row's E values, a broadcast load) so the two share one layout. The lane keeps its 8 columns x E experts
in registers across a chunk of CH rows (FFMA chains over the rows); the W warps' sums meet once at the end; each
program writes one (256, E) partial; a second small kernel adds the chunks' partials in chunk order (deterministic,
no atomics).
"""
import argparse, json, os, sys, time

_args = None
if __name__ == "__main__":
    _p = argparse.ArgumentParser()
    _p.add_argument("--check", action="store_true", help="CPU check under TRITON_INTERPRET=1 on small odd shapes")
    _p.add_argument("--rounds", type=int, default=5)
    _p.add_argument("--dry", action="store_true", help="the GPU path (checks, timing loop, table, JSON) on the CPU under "
                    "TRITON_INTERPRET=1 at a small shape, with a wall-clock timer: tests the script, times nothing")
    _p.add_argument("--compile", action="store_true", help="compile every variant for sm_90 without a GPU (run "
                    "it under the GPU machine's Triton, 3.6, for numbers that match it) and print registers, spills, shared memory and the main loop's SASS")
    _args = _p.parse_args()
    if _args.check or _args.dry: os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rtrainer import moe as _moe          # the route kernel, and the current kernels: the baseline arms

if os.environ.get("TRITON_INTERPRET") == "1":
    # the interpreter reads a kernel's source at its first call: read the current kernels' now, in case moe.py is
    # being edited while the check runs
    for _k in (_moe.router_logits_kernel, _moe.router_grad_w_kernel, _moe.router_rowdot_kernel): _k.rewrite()

def _tl_dot_route(x, router, top_k):
    "The router_logits_kernel (tl.dot, E padded to 16) as route_tokens_triton ran it before the row-dot kernel: the baseline."
    x, router = x.contiguous(), router.contiguous()
    (N, D), E = x.shape, router.shape[1]
    probs = torch.empty(N, E, dtype=torch.float32, device=x.device)
    experts = torch.empty(N, max(top_k, 1), dtype=torch.int64, device=x.device)
    weights = torch.empty(N, max(top_k, 1), dtype=torch.float32, device=x.device)
    _moe.router_logits_kernel[(triton.cdiv(N, _moe.ROUTER_BLOCK_ROWS),)](
        x, router, probs, experts, weights, N, D, E, BLOCK_ROWS=_moe.ROUTER_BLOCK_ROWS, BLOCK_COLS=_moe.ROUTER_BLOCK_COLS,
        E_PAD=_moe._router_e_pad(E), TOP_K=top_k)
    return (probs, experts, weights) if top_k else probs

MAX_E = 8     # experts the row-dot kernels take (explicit per-expert accumulators); above this: the current kernels

# ----------------------------------------------------------------------------------------------------------------
# route: logits + softmax + top-k
# ----------------------------------------------------------------------------------------------------------------

# The route kernel is rtrainer.moe's router_rowdot_kernel (it came from this script, where it was first written with a
# num_stages knob: software pipelining through shared memory took 0.29 to 0.43 ms against 0.047, see
# experiments/results/router_variants.json, of commit bec5865). The configs below are its launch shapes.

# route configs: (NC lanes across columns, G row groups, R rows per lane, num_warps).
# G = (32 // NC) * num_warps keeps each lane on R rows of its own (no replication); rows per program = G * R.
ROUTE_CONFIGS = {
    "rd32_g4r8_w4":    (32, 4, 8, 4),    # 32 rows/program (512 programs at N=16384), 128 cols per step: rtrainer's ROUTER_ROWDOT
    "rd32_g4r4_w4":    (32, 4, 4, 4),    # 16 rows/program (1024 programs)
    "rd32_g2r8_w2":    (32, 2, 8, 2),    # 16 rows/program, 2 warps
    "rd16_g8r4_w4":    (16, 8, 4, 4),    # 32 rows/program, 64 cols per step
    "rd32_g8r8_w8":    (32, 8, 8, 8),    # 64 rows/program, 8 warps
}
DEFAULT_ROUTE = "rd32_g4r8_w4"

def _route_e_pad(E): return max(2, triton.next_power_of_2(E))

def _applies(x, router):
    return router.dtype == torch.float32 and x.dtype in (torch.float32, torch.bfloat16, torch.float16)

def _route_launch(x, router, top_k, config, router_t):
    (N, D), E = x.shape, router.shape[1]
    NC, G, R, warps = ROUTE_CONFIGS[config] if isinstance(config, str) else config
    x = x.contiguous()
    wt = router_t if router_t is not None else router.t().contiguous()        # (E, D) fp32: 16-byte router loads
    probs = torch.empty(N, E, dtype=torch.float32, device=x.device)
    if top_k:
        experts = torch.empty(N, top_k, dtype=torch.int64, device=x.device)
        weights = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    else:
        experts = weights = probs                                              # not written
    _moe.router_rowdot_kernel[(triton.cdiv(N, G * R),)](x, wt, probs, experts, weights, N, D, E=E, E_PAD=_route_e_pad(E),
                                                         TOP_K=top_k, NC=NC, G=G, R=R,
                                                         EVEN=N % (G * R) == 0 and D % (NC * 4) == 0, num_warps=warps)
    return probs, experts, weights

def route_rowdot(x, router, top_k, config=DEFAULT_ROUTE, router_t=None):
    """Drop-in for moe.route_tokens_triton: (probs (N, E) fp32, top_experts (N, k) int64, top_weights (N, k) fp32),
    ties to the lower expert. `router_t`: router.t().contiguous() if the caller has it (saves a small transpose)."""
    if x.dim() != 2 or router.dim() != 2 or x.shape[1] != router.shape[0]:
        raise ValueError(f"route_rowdot: x {tuple(x.shape)} and router {tuple(router.shape)} do not make an (N, D) @ (D, E) product")
    E = router.shape[1]
    if not 1 <= top_k <= E: raise ValueError(f"route_rowdot: need 1 <= top_k <= {E} experts, got top_k={top_k}")
    if E > MAX_E or not _applies(x, router): return _moe.route_tokens_triton(x, router, top_k)
    return _route_launch(x, router, top_k, config, router_t)

def logits_rowdot(x, router, config=DEFAULT_ROUTE, router_t=None):
    "Drop-in for moe.router_logits_triton: fp32 logits (N, E), no autograd."
    if x.dim() != 2 or router.dim() != 2 or x.shape[1] != router.shape[0]:
        raise ValueError(f"logits_rowdot: x {tuple(x.shape)} and router {tuple(router.shape)} do not make an (N, D) @ (D, E) product")
    if router.shape[1] > MAX_E or not _applies(x, router): return _moe.router_logits_triton(x, router)
    return _route_launch(x, router, 0, config, router_t)[0]

# ----------------------------------------------------------------------------------------------------------------
# router weight gradient: x^T @ dlogits
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _grad_expert(x, g, v, e, a, r):
    # a + sum over the lane's R rows of x[row, its 8 columns] * dlogits[row, e]: FFMA chains over the rows
    bits = tl.where(v == e, g.to(tl.int32, bitcast=True), 0)                  # g[..., e]: an in-thread pick, integer adds of
    ge = tl.sum(bits, 3).to(tl.float32, bitcast=True)                         # zeros (exact; they fold away on the GPU)
    p = x * ge[:, :, :, None]
    return tl.sum(tl.where(r == 0, p + a[:, :, None, :], p), 2)              # (32, W, 8)

@triton.jit
def grad_w_rowdot_kernel(x_ptr, g_ptr, part_ptr, N, D, E: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
                         CH: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr):
    # EVEN: N a multiple of CH, CH of W*R and D of 256 (no masks in the loop but dlogits' columns past E when E < 8).
    # read CH rows x 256 columns of x and CH*E of dlogits, write a (256, E) partial per program
    c = tl.arange(0, 32)[:, None, None, None]
    w = tl.arange(0, W)[None, :, None, None]
    r = tl.arange(0, R)[None, None, :, None]
    v = tl.arange(0, 8)[None, None, None, :]
    cols = tl.program_id(0) * 256 + c * 8 + v                                 # (32, 1, 1, 8)
    chunk = tl.program_id(1)
    zc = c * 0                                                                # gives the dlogits loads x's (32, W, R, 8) shape
    a0 = tl.zeros([32, W, 8], tl.float32)
    a1 = tl.zeros([32, W, 8], tl.float32)
    a2 = tl.zeros([32, W, 8], tl.float32)
    a3 = tl.zeros([32, W, 8], tl.float32)
    a4 = tl.zeros([32, W, 8], tl.float32)
    a5 = tl.zeros([32, W, 8], tl.float32)
    a6 = tl.zeros([32, W, 8], tl.float32)
    a7 = tl.zeros([32, W, 8], tl.float32)
    hi = CH if EVEN else tl.minimum(CH, N - chunk * CH)                       # a short last chunk: fewer steps
    for r0 in tl.range(0, hi, W * R, num_stages=STAGES):
        rows = chunk * CH + r0 + w * R + r                                    # (1, W, R, 1)
        g_ptrs = g_ptr + rows.to(tl.int64) * E + zc + v                       # (32, W, R, 8): the row's E values, every lane
        if EVEN:
            x = tl.load(x_ptr + rows.to(tl.int64) * D + cols).to(tl.float32)
            if E == 8:
                g = tl.load(g_ptrs)
            else:
                g = tl.load(g_ptrs, mask=v < E, other=0.0)
        else:
            live = rows < N
            x = tl.load(x_ptr + rows.to(tl.int64) * D + cols, mask=live & (cols < D), other=0.0).to(tl.float32)
            g = tl.load(g_ptrs, mask=live & (v < E), other=0.0)
        a0 = _grad_expert(x, g, v, 0, a0, r)
        if E > 1: a1 = _grad_expert(x, g, v, 1, a1, r)
        if E > 2: a2 = _grad_expert(x, g, v, 2, a2, r)
        if E > 3: a3 = _grad_expert(x, g, v, 3, a3, r)
        if E > 4: a4 = _grad_expert(x, g, v, 4, a4, r)
        if E > 5: a5 = _grad_expert(x, g, v, 5, a5, r)
        if E > 6: a6 = _grad_expert(x, g, v, 6, a6, r)
        if E > 7: a7 = _grad_expert(x, g, v, 7, a7, r)
    cols2 = tl.program_id(0) * 256 + tl.arange(0, 32)[:, None] * 8 + tl.arange(0, 8)[None, :]   # (32, 8)
    out = part_ptr + (chunk * D + cols2).to(tl.int64) * E
    m = cols2 < D
    tl.store(out + 0, tl.sum(a0, 1), mask=m)            # the W warps' sums, in a fixed order
    if E > 1: tl.store(out + 1, tl.sum(a1, 1), mask=m)
    if E > 2: tl.store(out + 2, tl.sum(a2, 1), mask=m)
    if E > 3: tl.store(out + 3, tl.sum(a3, 1), mask=m)
    if E > 4: tl.store(out + 4, tl.sum(a4, 1), mask=m)
    if E > 5: tl.store(out + 5, tl.sum(a5, 1), mask=m)
    if E > 6: tl.store(out + 6, tl.sum(a6, 1), mask=m)
    if E > 7: tl.store(out + 7, tl.sum(a7, 1), mask=m)

@triton.jit
def sum_chunks_kernel(part_ptr, out_ptr, M, CHUNKS, BLOCK: tl.constexpr):
    # out[i] = sum over chunks, in chunk order, of part[chunk, i]: deterministic
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for ch in range(0, CHUNKS):
        acc += tl.load(part_ptr + ch * M + offs, mask=offs < M, other=0.0)
    tl.store(out_ptr + offs, acc, mask=offs < M)

# grad configs: (W warps splitting the rows, R rows per lane per step, CH rows per program, pipeline stages)
GRAD_CONFIGS = {
    "gw_w4r4_ch512":    (4, 4, 512, 1),     # 12 x 32 = 384 programs at N=16384, D=3072
    "gw_w4r4_ch512_s3": (4, 4, 512, 3),
    "gw_w4r8_ch512":    (4, 8, 512, 1),
    "gw_w4r8_ch512_s2": (4, 8, 512, 2),
    "gw_w4r4_ch256":    (4, 4, 256, 1),     # 768 programs
    "gw_w2r4_ch256_s2": (2, 4, 256, 2),     # 768 programs of 2 warps
    "gw_w8r4_ch1024":   (8, 4, 1024, 1),    # 192 programs of 8 warps
    "gw_w4r8_ch1024_s3": (4, 8, 1024, 3),   # 192 programs, deep pipeline
}
DEFAULT_GRAD = "gw_w4r4_ch512"

def grad_w_rowdot(x, grad_logits, router, config=DEFAULT_GRAD):
    """Drop-in for moe.router_weight_grad_triton: x^T @ grad_logits (D, E) fp32, deterministic (fixed-order sums)."""
    if x.dim() != 2 or router.dim() != 2 or x.shape[1] != router.shape[0]:
        raise ValueError(f"grad_w_rowdot: x {tuple(x.shape)} and router {tuple(router.shape)} do not make an (N, D) @ (D, E) product")
    (N, D), E = x.shape, router.shape[1]
    if E > MAX_E or not _applies(x, router): return _moe.router_weight_grad_triton(x, grad_logits, router)
    W, R, CH, stages = GRAD_CONFIGS[config] if isinstance(config, str) else config
    x, g = x.contiguous(), grad_logits.float().contiguous()
    chunks = triton.cdiv(N, CH)
    part = torch.empty(chunks, D, E, dtype=torch.float32, device=x.device)
    even = N % CH == 0 and CH % (W * R) == 0 and D % 256 == 0
    grad_w_rowdot_kernel[(triton.cdiv(D, 256), chunks)](x, g, part, N, D, E=E, W=W, R=R, CH=CH, STAGES=stages, EVEN=even,
                                                         num_warps=W)
    if chunks == 1: return part[0]
    out = torch.empty(D, E, dtype=torch.float32, device=x.device)
    sum_chunks_kernel[(triton.cdiv(D * E, 1024),)](part, out, D * E, chunks, BLOCK=1024, num_warps=4)
    return out

# ----------------------------------------------------------------------------------------------------------------
# checks and timing
# ----------------------------------------------------------------------------------------------------------------

def reference_route(x, router, top_k):
    "float64 route: (probs, top_experts, top_weights); ties to the lower expert (stable sort)."
    probs = (x.double() @ router.double()).softmax(-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(1, order)
    return probs, order, top / top.sum(-1, keepdim=True), probs

def route_errors(out, ref, top_k, tie_tol):
    """max relative errors of probs and (on rows routed alike) weights; route mismatches, and how many of them are not
    at a near-tie of the float64 reference (adjacent sorted probabilities among the first k+1 closer than tie_tol)"""
    probs, experts, weights = (t.cpu() for t in out)
    rprobs, rexperts, rweights, _ = (t.cpu() for t in ref)
    mism = (experts != rexperts).any(-1)
    srt = torch.sort(rprobs, dim=-1, descending=True).values[:, :top_k + 1]
    gaps = srt[:, :-1] - srt[:, 1:]
    near_tie = gaps.min(-1).values < tie_tol if gaps.shape[1] else torch.zeros(srt.shape[0], dtype=torch.bool)
    rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item() if b.numel() else 0.0
    return dict(probs_err=rel(probs, rprobs), weights_err=rel(weights[~mism], rweights[~mism]),
                route_mismatch=int(mism.sum()), mismatch_not_near_tie=int((mism & ~near_tie).sum()),
                near_ties=int(near_tie.sum()))

def make_inputs(N, D, E, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g).to(dtype).to(device)
    router = torch.randn(D, E, generator=g).mul(0.05).to(device)
    grad_logits = torch.randn(N, E, generator=g).to(device)
    return x, router, grad_logits

def check_all(shapes, dtype, device, route_configs, grad_configs, tie_tol=1e-6, log=print, top_ks=None):
    "every variant (and the current kernels) against float64; returns a list of result dicts"
    results = []
    for (N, D, E) in shapes:
        x, router, gl = make_inputs(N, D, E, dtype, device)
        rgrad = x.double().T @ gl.double()
        rlogits = x.double() @ router.double()
        rel = lambda a, b: ((a.double() - b).abs().max() / b.abs().max()).item()
        arms = {f"route:{c}": (lambda k, c=c: route_rowdot(x, router, k, c)) for c in route_configs}
        arms["route:current"] = lambda k: _tl_dot_route(x, router, k)
        for top_k in (top_ks or sorted({1, 2, min(3, E)})):
            ref = reference_route(x, router, top_k)
            for name, fn in arms.items():
                err = route_errors(fn(top_k), ref, top_k, tie_tol)
                ok = err["mismatch_not_near_tie"] == 0 and err["probs_err"] < 1e-5 and err["weights_err"] < 1e-5
                results.append(dict(shape=(N, D, E), top_k=top_k, arm=name, ok=ok, **err))
                log(f"N={N} D={D} E={E} k={top_k} {name:24s} probs {err['probs_err']:.2e} weights {err['weights_err']:.2e} "
                    f"route mismatches {err['route_mismatch']} (not at a near-tie: {err['mismatch_not_near_tie']}) {'ok' if ok else 'FAIL'}")
        for name, fn in [(f"logits:{c}", lambda c=c: logits_rowdot(x, router, c)) for c in route_configs[:1]] + \
                        ([("logits:current", lambda: _tl_dot_route(x, router, 0))]):
            e = rel(fn(), rlogits)
            results.append(dict(shape=(N, D, E), arm=name, ok=e < 1e-5, logits_err=e))
            log(f"N={N} D={D} E={E}     {name:24s} logits {e:.2e} {'ok' if e < 1e-5 else 'FAIL'}")
        garms = {f"grad:{c}": (lambda c=c: grad_w_rowdot(x, gl, router, c)) for c in grad_configs}
        garms["grad:current"] = lambda: _moe.router_weight_grad_triton(x, gl, router)
        for name, fn in garms.items():
            a, b = fn(), fn()
            e = rel(a, rgrad)
            det = bool(torch.equal(a, b))
            results.append(dict(shape=(N, D, E), arm=name, ok=e < 1e-5 and det, grad_err=e, deterministic=det))
            log(f"N={N} D={D} E={E}     {name:24s} grad {e:.2e} deterministic {det} {'ok' if e < 1e-5 and det else 'FAIL'}")
    return results

def cpu_check():
    # N, D off the blocks' multiples; E not a power of 2; N=600 gives the gradient 2-3 row chunks, D=520 three column blocks
    # (1024, 256, 8) and (1024, 512, 6) are even: the unmasked paths of every config
    shapes = [(77, 200, 8), (77, 200, 6), (50, 136, 3), (33, 520, 8), (600, 72, 8), (1024, 256, 8), (1024, 512, 6)]
    res = check_all(shapes, torch.bfloat16, "cpu", list(ROUTE_CONFIGS), list(GRAD_CONFIGS))
    x, router, gl = make_inputs(40, 72, 4, torch.float32, "cpu")              # fp32 x (other layouts) on one config each
    ref = reference_route(x, router, 2)
    e1 = route_errors(route_rowdot(x, router, 2), ref, 2, 1e-6)
    e2 = ((grad_w_rowdot(x, gl, router).double() - x.double().T @ gl.double()).abs().max() / (x.double().T @ gl.double()).abs().max()).item()
    print(f"fp32 x, N=40 D=72 E=4 k=2: route {e1}, grad {e2:.2e}")
    res.append(dict(arm="fp32 x", ok=e1["mismatch_not_near_tie"] == 0 and e1["probs_err"] < 1e-5 and e2 < 1e-5))
    bad = [r for r in res if not r["ok"]]
    print(f"{len(res) - len(bad)}/{len(res)} checks ok" + (f"; FAILED: {bad}" if bad else ""))
    return not bad

def _sass_loops(cubin):
    "opcode counts of each backward-branch loop body in the SASS of `cubin` (nvdisasm from Triton's package)"
    import collections, re, subprocess, tempfile
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as t:
        p = os.path.join(t, "k.cubin")
        with open(p, "wb") as f: f.write(cubin)
        lines = subprocess.run([nvdisasm, "-c", p], capture_output=True, text=True).stdout.splitlines()
    out = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", l)
        if not m: continue
        j = next((k for k, ll in enumerate(lines) if ll.startswith("." + m.group(1))), None)
        if j is None or j >= i - 2: continue
        cnt = collections.Counter()
        for b in lines[j:i + 1]:
            mm = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)", b)
            if mm: cnt[mm.group(2)] += 1
        out.append(cnt)
    return out

def compile_check():
    "every variant compiled for sm_90 (bf16 x, E=8): registers, spills, shared memory, and the main loop's instruction mix"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sm90_compile import compile_sm90, ptxas_usage
    keep = ("FFMA", "FADD", "FMUL", "FSEL", "FMNMX", "LDG", "LDGSTS", "LDS", "STS", "SHFL", "BAR", "LDL", "STL")
    def show(name, c):
        loops = _sass_loops(c.asm["cubin"])
        main = max(loops, key=lambda k: k["FFMA"]) if loops else {}
        mix = {k: v for k, v in sorted(main.items()) if k.startswith(keep)}
        print(f"{name:22s} regs/spilled {ptxas_usage(c.asm['ptx'])} smem {c.metadata.shared:6d} "
              f"layout conversions {c.asm['ttgir'].count('convert_layout')}; main loop: {mix} ({sum(main.values())} instr)")
    for name, (NC, G, R, warps) in ROUTE_CONFIGS.items():
        sig = dict(x_ptr="*bf16", wt_ptr="*fp32", out_ptr="*fp32", experts_ptr="*i64", weights_ptr="*fp32", N="i32", D="i32")
        show(name, compile_sm90(_moe.router_rowdot_kernel, sig, dict(E=8, E_PAD=8, TOP_K=2, NC=NC, G=G, R=R, EVEN=True),
                                hints=("x_ptr", "wt_ptr", "D"), warps=warps))
    for name, (W, R, CH, stages) in GRAD_CONFIGS.items():
        sig = dict(x_ptr="*bf16", g_ptr="*fp32", part_ptr="*fp32", N="i32", D="i32")
        show(name, compile_sm90(grad_w_rowdot_kernel, sig, dict(E=8, W=W, R=R, CH=CH, STAGES=stages, EVEN=True),
                                hints=("x_ptr", "g_ptr", "part_ptr", "D"), warps=W, stages=stages))
    # the tl.dot kernels, for comparison
    sig = dict(x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", experts_ptr="*i64", weights_ptr="*fp32", N="i32", D="i32", E="i32")
    show("current route", compile_sm90(_moe.router_logits_kernel, sig, dict(BLOCK_ROWS=64, BLOCK_COLS=128, E_PAD=16, TOP_K=2),
                                       hints=("x_ptr", "w_ptr", "D")))
    sig = dict(x_ptr="*bf16", g_ptr="*fp32", part_ptr="*fp32", N="i32", D="i32", E="i32")
    show("current grad", compile_sm90(_moe.router_grad_w_kernel, sig, dict(CHUNK_ROWS=512, BLOCK_ROWS=64, BLOCK_COLS=128, E_PAD=16),
                                      hints=("x_ptr", "D")))

def _wall_ms(fn, **_):
    t = time.perf_counter(); fn(); return (time.perf_counter() - t) * 1e3

def gpu_main(rounds, dry=False):
    dev, bench = ("cpu", _wall_ms) if dry else ("cuda", triton.testing.do_bench)
    N, D, E, K = (96, 256, 8, 2) if dry else (16384, 3072, 8, 2)
    device_name = "cpu (dry run)" if dry else torch.cuda.get_device_name()
    t0 = time.time()
    print(f"device {device_name}, triton {triton.__version__}, torch {torch.__version__}")
    # correctness at the full shape (this also compiles every variant)
    res = check_all([(N, D, E)], torch.bfloat16, dev, list(ROUTE_CONFIGS), list(GRAD_CONFIGS), log=lambda s: None, top_ks=[K])
    x, router, gl = make_inputs(N, D, E, torch.bfloat16, dev)
    # agreement of the routes with the current kernel
    cur = _tl_dot_route(x, router, K)
    for c in ROUTE_CONFIGS:
        o = route_rowdot(x, router, K, c)
        for r in res:
            if r["arm"] == f"route:{c}" and r.get("top_k") == K:
                r["route_diff_vs_current"] = int((o[1] != cur[1]).any(-1).sum())
                r["probs_maxdiff_vs_current"] = (o[0] - cur[0]).abs().max().item()
    for r in res:
        print("check", {k: (round(v, 9) if isinstance(v, float) else v) for k, v in r.items()})
    print(f"checks done in {time.time() - t0:.1f} s")
    arms = {}
    arms["route:current"] = lambda: _tl_dot_route(x, router, K)
    for c in ROUTE_CONFIGS: arms[f"route:{c}"] = lambda c=c: route_rowdot(x, router, K, c)
    wt = router.t().contiguous()
    arms[f"route:{DEFAULT_ROUTE}+pre_t"] = lambda: route_rowdot(x, router, K, DEFAULT_ROUTE, router_t=wt)
    arms["route:transpose_only"] = lambda: router.t().contiguous()
    arms["grad:current"] = lambda: _moe.router_weight_grad_triton(x, gl, router)
    for c in GRAD_CONFIGS: arms[f"grad:{c}"] = lambda c=c: grad_w_rowdot(x, gl, router, c)
    times = {a: [] for a in arms}
    names = list(arms)
    for rd in range(rounds):                 # alternate the order of the arms round by round
        for a in (names if rd % 2 == 0 else names[::-1]):
            times[a].append(bench(arms[a], warmup=10, rep=30, return_mode="median"))
    med = {a: sorted(t)[len(t) // 2] for a, t in times.items()}
    base = {"route": med.get("route:current"), "grad": med.get("grad:current")}
    print(f"\n{'variant':34s} {'ms':>8s} {'speedup':>8s}   (median of {rounds} rounds of do_bench medians; "
          f"x {N}x{D} bf16 = {N * D * 2 / 1e6:.0f} MB: {N * D * 2 / 4.3e12 * 1e3:.4f} ms at 4.3 TB/s)")
    rows = []
    for a in names:
        kind = a.split(":")[0]
        sp = base[kind] / med[a] if base.get(kind) and not a.endswith("transpose_only") else float("nan")
        rows.append(dict(arm=a, ms=med[a], speedup_vs_current=sp, rounds_ms=times[a]))
        print(f"{a:34s} {med[a]:8.4f} " + (f"{sp:8.2f}x" if sp == sp else f"{'-':>8s}"))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "router_variants.json"), "w") as f:
            json.dump(dict(device=device_name, triton=triton.__version__, torch=torch.__version__,
                           shape=dict(N=N, D=D, E=E, top_k=K), checks=res, timings=rows,
                           route_configs=ROUTE_CONFIGS, grad_configs=GRAD_CONFIGS, wall_s=time.time() - t0), f, indent=1)
    print(f"total {time.time() - t0:.1f} s")
    return all(r["ok"] for r in res)

if __name__ == "__main__":
    if _args.compile:
        compile_check()
        sys.exit(0)
    if _args.check:
        t = time.time()
        ok = cpu_check()
        print(f"cpu check {'passed' if ok else 'FAILED'} in {time.time() - t:.0f} s")
        sys.exit(0 if ok else 1)
    if _args.dry: sys.exit(0 if gpu_main(_args.rounds, dry=True) else 1)
    if not torch.cuda.is_available(): sys.exit("no CUDA device: run with --check (CPU, TRITON_INTERPRET=1)")
    sys.exit(0 if gpu_main(_args.rounds) else 1)
