"""Where does the causal flash-attention forward lose to cuDNN on the H200? One GPU run (about 2-3 minutes, compiles
included) builds forward variants, checks each against a float64 reference (bf16, causal, GQA, T not a multiple of
the tile) and times them against SDPA's cuDNN backend at rb100m, dense1b and moe4b, arms alternating over 3 rounds:
  baseline     rtrainer's autotuned flash_attention_forward, as is
  tma          Q, K, V loaded and O stored through device-side tensor descriptors over the (B, T, heads*hd) views
  tma_host     the same kernel handed host-built descriptors (no per-program descriptor creation, no workspace)
  tma_ws       tma with its KV loops as tl.range(..., warp_specialize=True) (Hopper automatic warp specialization);
               in Triton 3.6 for sm_90 4 warps fail to compile (the partitioner rejects the 3-D tile's reshape) and
               8 warps compile without being specialized
  tma_1loop    tma over per-(batch, head) 2-D descriptors [T, hd] and one KV loop masking every block: what
               Triton 3.6 can warp-specialize on Hopper
  tma_ws1      tma_1loop with warp_specialize=True at 4 warps (compiled: producer and consumer partitions)
  heavy_first  the baseline's math with the query blocks reversed within each head: the longest program starts first
  heavy_lpt    the same over a grid (B*H, query blocks): every head's last query block before any next-to-last one
`python experiments/attention_variants.py` on a GPU (writes $OUT/attention_variants.json when OUT is set);
`TRITON_INTERPRET=1 python experiments/attention_variants.py --cpu-check` checks the kernels' math on the CPU in fp32;
`python experiments/attention_variants.py --compile-check` compiles every variant for sm_90 (no GPU) and prints shared memory."""
import inspect, json, math, os, statistics, sys, time
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from rtrainer.attention import flash_attention_forward, attention_flops, _forward_inner, LOG2_E
from rtrainer.kernels import median_ms, relative_error

TIME_GUARD_S = 330                                      # past this, remaining compiles and timings are skipped
ROUNDS = 3
CHECK_SHAPES = {64: (2, 1000, 12, 4), 128: (1, 777, 16, 16)}   # head dim: (B, T, H, KV), T off every tile
TIME_SHAPES = {"rb100m": (32, 12, 4, 1024, 64), "dense1b": (16, 16, 16, 1024, 128), "moe4b": (16, 48, 48, 1024, 64)}
T_START = time.time()
DEVICE, DTYPE = "cuda", torch.bfloat16                # (a CPU dry run of gpu_main may swap them)

# ---------------------------------------------------------------------------------------------------- heavy first
@triton.jit
def heavy_first_kernel(
    Q, K, V, O, LSE,                                    # as rtrainer's flash_forward_kernel (causal only)
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh,
    H, T, GROUP, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LPT: tl.constexpr, PRECISION: tl.constexpr):
    if LPT:                                             # grid (B*H, query blocks): all heads' last blocks launch first
        bh, m_block = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    else:                                               # grid (query blocks, B*H): each head's last block launches first
        m_block, bh = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    start_m = m_block * BLOCK_M
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    kvh = h // GROUP                                    # GQA: query heads of one group share a KV head
    q_pos, offs_d = start_m + tl.arange(0, BLOCK_M), tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_pos[:, None] * stride_qt + offs_d[None, :],
                mask=q_pos[:, None] < T, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # rtrainer's own inner loop: the blocks below the diagonal unmasked, then the diagonal ones masked
    acc, m_i, l_i = _forward_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, 0, start_m, T,
                                   scale_log2, BLOCK_N, HEAD_DIM, False, True, PRECISION)
    acc, m_i, l_i = _forward_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, start_m,
                                   tl.minimum(start_m + BLOCK_M, T), T, scale_log2, BLOCK_N, HEAD_DIM, True, True, PRECISION)
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + q_pos[:, None] * stride_ot + offs_d[None, :],
             acc.to(O.dtype.element_ty), mask=q_pos[:, None] < T)
    tl.store(LSE + (b * H + h) * T + q_pos, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

def heavy_forward(q, k, v, o=None, lse=None, *, lpt=False, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3):
    "Launch heavy_first_kernel; returns (o, lse) like flash_attention_forward."
    B, T, H, hd = q.shape
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32) if lse is None else lse
    n_m = triton.cdiv(T, BLOCK_M)
    heavy_first_kernel[(B * H, n_m) if lpt else (n_m, B * H)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, T, H // k.shape[2], LOG2_E / math.sqrt(hd), HEAD_DIM=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, LPT=lpt,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages)
    return o, lse

# ------------------------------------------------------------------------------------------------------------ TMA
@triton.jit
def _descriptor(base, shape, strides, block_shape):
    "A host-built descriptor as is; else a device-side one made by this program (workspace from triton.set_allocator)."
    if isinstance(base, tl.tensor_descriptor):
        return base
    else:
        return tl.make_tensor_descriptor(base, shape, strides, block_shape)

@triton.jit
def _tile(desc, b, row, col, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, PER_HEAD: tl.constexpr):
    "The (ROWS, hd) tile at `row` of a head: [row, 0] of a per-head 2-D descriptor, else [b, row, col] of a 3-D one."
    if PER_HEAD:
        return desc.load([row, 0])
    else:
        return desc.load([b, row, col]).reshape(ROWS, HEAD_DIM)

@triton.jit
def _tma_inner(acc, m_i, l_i, q, k_desc, v_desc, b, kv_col, q_pos, lo, hi, scale_log2,
               BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, WARP_SPEC: tl.constexpr,
               PER_HEAD: tl.constexpr, PRECISION: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = _tile(k_desc, b, start_n, kv_col, BLOCK_N, HEAD_DIM, PER_HEAD)    # rows past T arrive as zeros
        v = _tile(v_desc, b, start_n, kv_col, BLOCK_N, HEAD_DIM, PER_HEAD)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2   # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:                                      # causal; keys past T lie after every row < T
            s = tl.where(q_pos[:, None] >= start_n + tl.arange(0, BLOCK_N)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)   # rescale, accumulate in the MMA
        m_i = m_new
    return acc, m_i, l_i

@triton.jit(do_not_specialize=["B", "H", "KV", "T"])   # one compile per config and head dim, whatever the shape
def tma_forward_kernel(
    Q, K, V, O, LSE,                                    # q/o (B,T,H,hd), k/v (B,T,KV,hd) contiguous, or host descriptors
    B, H, KV, T, scale_log2,                            # over their (B, T, heads*hd) views; lse (B,H,T) fp32
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WARP_SPEC: tl.constexpr, PER_HEAD: tl.constexpr, ONE_LOOP: tl.constexpr, PRECISION: tl.constexpr):
    start_m, bh = tl.program_id(0) * BLOCK_M, tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // (H // KV)                                # GQA: query heads of one group share a KV head
    if PER_HEAD:   # 2-D descriptors over this (batch, head)'s [T, hd] slice: bounded at T too, and no reshape
                   # (which Hopper's warp specialization cannot partition in Triton 3.6)
        q_off = (b.to(tl.int64) * T * H + h) * HEAD_DIM          # element offset of this head's row 0
        kv_off = (b.to(tl.int64) * T * KV + kvh) * HEAD_DIM
        q_desc = tl.make_tensor_descriptor(Q + q_off, [T, HEAD_DIM], [H * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
        o_desc = tl.make_tensor_descriptor(O + q_off, [T, HEAD_DIM], [H * HEAD_DIM, 1], [BLOCK_M, HEAD_DIM])
        k_desc = tl.make_tensor_descriptor(K + kv_off, [T, HEAD_DIM], [KV * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V + kv_off, [T, HEAD_DIM], [KV * HEAD_DIM, 1], [BLOCK_N, HEAD_DIM])
    else:          # 3-D views: a block past T is cut at T (zeros on load, dropped on store), never spilling into batch b + 1
        q_desc = _descriptor(Q, [B, T, H * HEAD_DIM], [T * H * HEAD_DIM, H * HEAD_DIM, 1], [1, BLOCK_M, HEAD_DIM])
        o_desc = _descriptor(O, [B, T, H * HEAD_DIM], [T * H * HEAD_DIM, H * HEAD_DIM, 1], [1, BLOCK_M, HEAD_DIM])
        k_desc = _descriptor(K, [B, T, KV * HEAD_DIM], [T * KV * HEAD_DIM, KV * HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
        v_desc = _descriptor(V, [B, T, KV * HEAD_DIM], [T * KV * HEAD_DIM, KV * HEAD_DIM, 1], [1, BLOCK_N, HEAD_DIM])
    q_pos = start_m + tl.arange(0, BLOCK_M)
    q = _tile(q_desc, b, start_m, h * HEAD_DIM, BLOCK_M, HEAD_DIM, PER_HEAD)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kv_col, diag_end = kvh * HEAD_DIM, tl.minimum(start_m + BLOCK_M, T)
    if ONE_LOOP:   # every block masked: Hopper's warp specialization fails on two loops (Triton 3.6)
        acc, m_i, l_i = _tma_inner(acc, m_i, l_i, q, k_desc, v_desc, b, kv_col, q_pos, 0, diag_end, scale_log2,
                                   BLOCK_N, HEAD_DIM, True, WARP_SPEC, PER_HEAD, PRECISION)
    else:          # the blocks below the diagonal unmasked, then the diagonal ones masked
        acc, m_i, l_i = _tma_inner(acc, m_i, l_i, q, k_desc, v_desc, b, kv_col, q_pos, 0, start_m, scale_log2,
                                   BLOCK_N, HEAD_DIM, False, WARP_SPEC, PER_HEAD, PRECISION)
        acc, m_i, l_i = _tma_inner(acc, m_i, l_i, q, k_desc, v_desc, b, kv_col, q_pos, start_m, diag_end, scale_log2,
                                   BLOCK_N, HEAD_DIM, True, WARP_SPEC, PER_HEAD, PRECISION)
    acc = (acc / l_i[:, None]).to(q.dtype)
    if PER_HEAD:
        o_desc.store([start_m, 0], acc)
    else:
        o_desc.store([b, start_m, h * HEAD_DIM], acc.reshape(1, BLOCK_M, HEAD_DIM))
    tl.store(LSE + bh.to(tl.int64) * T + q_pos, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

def _tma_workspace(size, alignment, stream):
    "Global memory for device-side descriptors (128 bytes per descriptor per program)."
    return torch.empty(size, device="cuda", dtype=torch.uint8)

if torch.cuda.is_available(): triton.set_allocator(_tma_workspace)

def tma_forward(q, k, v, o=None, lse=None, *, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3,
                warp_spec=False, host=False, per_head=False, one_loop=False):
    "Launch tma_forward_kernel on contiguous q, k, v; `host` builds the (3-D) descriptors here instead of in the kernel."
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()): raise ValueError("tma: needs contiguous q, k, v")
    B, T, H, hd = q.shape
    KV = k.shape[2]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32) if lse is None else lse
    qkvo = (q, k, v, o)
    if host:
        from triton.tools.tensor_descriptor import TensorDescriptor
        qkvo = [TensorDescriptor.from_tensor(t.view(B, T, -1), [1, rows, hd])
                for t, rows in zip(qkvo, (BLOCK_M, BLOCK_N, BLOCK_N, BLOCK_M))]
    tma_forward_kernel[(triton.cdiv(T, BLOCK_M), B * H)](
        *qkvo, lse, B, H, KV, T, LOG2_E / math.sqrt(hd), HEAD_DIM=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        WARP_SPEC=warp_spec, PER_HEAD=per_head, ONE_LOOP=one_loop, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    return o, lse

# ------------------------------------------------------------------------------------------------------- variants
def _tma(m, n, w, s, **kw): return lambda q, k, v, o=None, lse=None: tma_forward(q, k, v, o, lse, BLOCK_M=m, BLOCK_N=n,
                                                                                   num_warps=w, num_stages=s, **kw)
def _heavy(lpt): return lambda q, k, v, o=None, lse=None: heavy_forward(q, k, v, o, lse, lpt=lpt)

VARIANTS = [  # name, head dims it serves, forward(q, k, v, o, lse) -> (o, lse); launch configs (BLOCK_M, BLOCK_N, warps, stages)
    ("baseline", (64, 128), lambda q, k, v, o=None, lse=None: flash_attention_forward(q, k, v, True, o, lse)),
    ("tma 128/64 w8 s3", (64, 128), _tma(128, 64, 8, 3)),
    ("tma 128/128 w8 s3", (64,), _tma(128, 128, 8, 3)),
    ("tma 128/64 w8 s2", (128,), _tma(128, 64, 8, 2)),
    ("tma_host 128/64 w8 s3", (64, 128), _tma(128, 64, 8, 3, host=True)),
    ("heavy_first 128/64 w8 s3", (64, 128), _heavy(False)),
    ("heavy_lpt 128/64 w8 s3", (64, 128), _heavy(True)),
    ("tma_1loop 128/64 w8 s3", (64, 128), _tma(128, 64, 8, 3, per_head=True, one_loop=True)),
    ("tma_ws1 128/64 w4 s3", (64, 128), _tma(128, 64, 4, 3, per_head=True, one_loop=True, warp_spec=True)),
    ("tma_ws 128/64 w4 s3", (64, 128), _tma(128, 64, 4, 3, warp_spec=True)),   # last: the likeliest to fail
    ("tma_ws 128/64 w8 s3", (64, 128), _tma(128, 64, 8, 3, warp_spec=True)),
]

# ---------------------------------------------------------------------------------------------------------- helpers
def one_line(e):
    "An exception as one line: its type, first line and (for compiler errors, whose message comes last) last line."
    lines = [l.strip() for l in str(e).splitlines() if l.strip()] or [""]
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return f"{type(e).__name__}: {text}"[:300]

def reference(q, k, v):
    "(o, lse) in float64: causal GQA attention with scores materialized."
    B, T, H, hd = q.shape
    group = H // k.shape[2]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 2), v.double().repeat_interleave(group, 2)
    scores = torch.einsum("bthd,bshd->bhts", q64, k64) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v64), scores.logsumexp(-1)

def check(fn, q, k, v, ref_o, ref_lse):
    "Relative errors (norm) of o and lse against the float64 reference; outputs start NaN so an unwritten row shows."
    B, T, H, hd = q.shape
    o = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, T), float("nan"), device=q.device, dtype=torch.float32)
    o, lse = fn(q, k, v, o, lse)
    if not (o.isfinite().all() and lse.isfinite().all()): raise ValueError("non-finite output (a row left unwritten?)")
    max_rel = ((o.double() - ref_o).abs().max() / ref_o.abs().max()).item()
    return dict(o_err=relative_error(o, ref_o), lse_err=relative_error(lse, ref_lse), o_max_rel=max_rel)

def sdpa_arm(gqa, cudnn):
    "SDPA on (B,T,heads,hd) tensors through transposed views, cuDNN only or the default backend choice."
    from torch.nn.attention import sdpa_kernel, SDPBackend
    def run(q, k, v):
        args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        kw = dict(is_causal=True, **(dict(enable_gqa=True) if gqa else {}))
        if not cudnn: return F.scaled_dot_product_attention(*args, **kw).transpose(1, 2)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*args, **kw).transpose(1, 2)
    return run

def elapsed(): return time.time() - T_START

def save(payload):
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_variants.json"), "w") as f: json.dump(payload, f, indent=1)

# ------------------------------------------------------------------------------------------------------------- GPU
def gpu_main():
    dev, bf16 = DEVICE, DTYPE
    torch.manual_seed(0)
    payload = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   checks=[], timings=[], notes=[])
    # the baseline autotunes at the first timing shape of each head dim, as rtrainer's benchmark_suite does
    for name in ("rb100m", "dense1b"):
        B, H, KV, T, hd = TIME_SHAPES[name]
        flash_attention_forward(*(torch.randn(B, T, n, hd, device=dev, dtype=bf16) for n in (H, KV, KV)))
    from rtrainer import attention as A
    payload["notes"].append(f"baseline forward configs: {[A.tuned_config('forward', hd, T) for _, _, _, T, hd in TIME_SHAPES.values()]}")
    print(payload["notes"][-1], f"({elapsed():.0f} s)", flush=True)

    # ---- correctness: every variant at the check shape of each head dim it serves
    passed = set()                                      # (variant, hd)
    for hd, (B, T, H, KV) in CHECK_SHAPES.items():
        q, k, v = torch.randn(B, T, H, hd, device=dev, dtype=bf16), *(torch.randn(B, T, KV, hd, device=dev, dtype=bf16) for _ in range(2))
        ref_o, ref_lse = reference(q, k, v)
        floor = dict(variant="sdpa default (bf16 floor)", hd=hd, shape=f"B{B} T{T} H{H} KV{KV}", ok=True)
        try:
            sdpa_o = sdpa_arm(H != KV, cudnn=False)(q, k, v).double()
            floor.update(o_err=relative_error(sdpa_o, ref_o), o_max_rel=((sdpa_o - ref_o).abs().max() / ref_o.abs().max()).item())
        except Exception as e: floor["error"] = one_line(e)
        payload["checks"].append(floor)
        print(f"check hd{hd} B{B} T{T} H{H} KV{KV}: sdpa default " + (f"o {floor['o_err']:.2e} max-rel {floor['o_max_rel']:.2e}"
              if "o_err" in floor else floor["error"]), flush=True)
        for name, hds, fn in VARIANTS:
            if hd not in hds: continue
            row = dict(variant=name, hd=hd, shape=f"B{B} T{T} H{H} KV{KV}")
            if elapsed() > TIME_GUARD_S: row.update(ok=False, error="skipped: time guard")
            else:
                t0 = time.time()
                try:
                    row.update(check(fn, q, k, v, ref_o, ref_lse))
                    row["ok"] = max(row["o_err"], row["lse_err"], row["o_max_rel"]) < 1e-2
                    if not row["ok"]: row["error"] = "wrong: an error >= 1e-2"
                except Exception as e: row.update(ok=False, error=one_line(e))
                row["compile_and_check_s"] = round(time.time() - t0, 1)
            if row["ok"]: passed.add((name, hd))
            payload["checks"].append(row)
            print(f"  {name:26s} " + (f"o {row['o_err']:.2e} lse {row['lse_err']:.2e} max-rel {row['o_max_rel']:.2e}"
                  if "o_err" in row else "") + ("" if row["ok"] else f"  FAILED {row['error']}") +
                  f"  [{row.get('compile_and_check_s', 0)} s, at {elapsed():.0f} s]", flush=True)
        q = k = v = ref_o = ref_lse = None   # freed (the lambdas hold the names)
        save(payload)

    # ---- timing: forward only, arms alternating over rounds, median of the per-round medians
    for label, (B, H, KV, T, hd) in TIME_SHAPES.items():
        if elapsed() > TIME_GUARD_S: payload["notes"].append(f"{label}: timing skipped (time guard)"); continue
        q, k, v = torch.randn(B, T, H, hd, device=dev, dtype=bf16), *(torch.randn(B, T, KV, hd, device=dev, dtype=bf16) for _ in range(2))
        flops = attention_flops(B, H, T, hd)
        arms = {}
        try:
            sdpa_arm(H != KV, cudnn=True)(q, k, v); arms["cudnn"] = sdpa_arm(H != KV, cudnn=True)
        except Exception as e:
            payload["notes"].append(f"{label}: cuDNN refused ({one_line(e)}); the reference arm is SDPA's default backend")
            print(payload["notes"][-1], flush=True)
            arms["sdpa default"] = sdpa_arm(H != KV, cudnn=False)
        ref_name = next(iter(arms))
        for name, hds, fn in VARIANTS:
            if (name, hd) not in passed: continue
            if elapsed() > TIME_GUARD_S: payload["notes"].append(f"{label} {name}: skipped (time guard)"); continue
            try: fn(q, k, v); torch.cuda.synchronize(); arms[name] = fn          # compile at this shape
            except Exception as e:
                payload["timings"].append(dict(variant=name, shape=label, error=one_line(e)))
                print(f"  {label} {name}: FAILED {one_line(e)}", flush=True)
        times = {name: [] for name in arms}
        for r in range(ROUNDS):
            for name, fn in arms.items():
                if elapsed() > TIME_GUARD_S: break
                try: times[name].append(median_ms(lambda: fn(q, k, v)))
                except Exception as e: payload["notes"].append(f"{label} {name} round {r}: {one_line(e)}")
        ref_ms = statistics.median(times[ref_name]) if times[ref_name] else float("nan")
        for name, runs in times.items():
            if not runs: continue
            ms = statistics.median(runs)
            payload["timings"].append(dict(variant=name, shape=label, B=B, H=H, KV=KV, T=T, hd=hd, ms=ms, rounds_ms=runs,
                                           tflops=flops / ms / 1e9, vs_ref=ref_ms / ms, ref=ref_name))
        print(f"timed {label} ({len(arms)} arms) at {elapsed():.0f} s", flush=True)
        q = k = v = None   # freed (the lambdas hold the names)
        save(payload)

    # ---- summary: failures, then the table
    for row in payload["checks"]:
        if not row["ok"]: print(f"FAILED check {row['variant']} hd{row['hd']}: {row['error']}")
    for row in payload["timings"]:
        if "error" in row: print(f"FAILED timing {row['variant']} {row['shape']}: {row['error']}")
    for note in payload["notes"]: print("note:", note)
    print(f"\n{'variant':28s} {'shape':8s} {'ms':>8s} {'TFLOP/s':>8s} {'x cuDNN':>8s}   (cuDNN ms / variant ms: >1 is faster;"
          " * = SDPA's default backend stood in for cuDNN)")
    for row in (r for r in payload["timings"] if "ms" in r):
        star = "" if row["ref"] == "cudnn" else "*"
        print(f"{row['variant']:28s} {row['shape']:8s} {row['ms']:8.4f} {row['tflops']:8.1f} {row['vs_ref']:7.3f}{star}")
    payload["total_s"] = elapsed()
    print(f"total {elapsed():.0f} s")
    save(payload)

# ------------------------------------------------------------------------------------------- local checks (no GPU)
def cpu_check():
    "TRITON_INTERPRET=1: every variant's kernel in fp32 on small shapes against the float64 reference."
    torch.manual_seed(0)
    small = lambda m, n: dict(BLOCK_M=m, BLOCK_N=n, num_warps=4, num_stages=2)
    kernels = {
        "baseline (rtrainer, 16/16)": lambda q, k, v, o, lse: flash_attention_forward(q, k, v, True, o, lse),
        **{f"{kind} {m}/{n}": (lambda kw: lambda q, k, v, o, lse: tma_forward(q, k, v, o, lse, **kw))(dict(small(m, n), **extra))
           for kind, extra in (("tma", {}), ("tma_host", dict(host=True)), ("tma_ws", dict(warp_spec=True)),
                               ("tma_1loop", dict(per_head=True, one_loop=True)),
                               ("tma_ws1", dict(per_head=True, one_loop=True, warp_spec=True)))
           for m, n in ((16, 16), (32, 16))},
        **{f"{kind} {m}/{n}": (lambda lpt, kw: lambda q, k, v, o, lse: heavy_forward(q, k, v, o, lse, lpt=lpt, **kw))(lpt, small(m, n))
           for kind, lpt in (("heavy_first", False), ("heavy_lpt", True)) for m, n in ((16, 16), (32, 16))},
    }
    worst = 0.0
    for B, T, H, KV, hd in ((1, 37, 4, 2, 16), (2, 37, 4, 2, 32), (1, 50, 3, 3, 16), (2, 5, 2, 1, 16)):
        q, k, v = torch.randn(B, T, H, hd), torch.randn(B, T, KV, hd), torch.randn(B, T, KV, hd)
        ref_o, ref_lse = reference(q, k, v)
        for name, fn in kernels.items():
            try:
                errs = check(fn, q, k, v, ref_o, ref_lse)
                worst = max(worst, errs["o_err"], errs["lse_err"])
                print(f"B{B} T{T} H{H} KV{KV} hd{hd} {name:22s} o {errs['o_err']:.1e} lse {errs['lse_err']:.1e}")
            except Exception as e: print(f"B{B} T{T} H{H} KV{KV} hd{hd} {name:22s} FAILED {one_line(e)}")
    print(f"worst relative error {worst:.1e}")

def compile_check():
    "Compile every variant for sm_90 (no GPU needed); print shared memory and ptxas's registers. Run it under the GPU's Triton."
    from sm90_compile import compile_sm90, ptxas_usage
    def compile_one(kernel, consts, warps, stages, descs=None):
        sig, hints = {}, []
        for p in inspect.signature(kernel.fn).parameters:
            if p in consts: continue
            elif descs and p in descs: sig[p] = descs[p]
            elif p in ("Q", "K", "V", "O", "LSE"): sig[p], hints = ("*fp32" if p == "LSE" else "*bf16"), hints + [p]
            elif p == "scale_log2": sig[p] = "fp32"
            else:                                       # what the launcher sees at the timing shapes: strides and T
                sig[p] = "i32"                          # multiples of 16 (the TMA kernel does not specialize T)
                if p.startswith("stride") or (p == "T" and "T" not in kernel.do_not_specialize): hints.append(p)
        return compile_sm90(kernel, sig, consts, hints, warps=warps, stages=stages)
    def registers(compiled):
        regs, spilled = ptxas_usage(compiled.asm["ptx"])
        return f"{regs if regs is not None else '?'} registers, {spilled if spilled is not None else '?'} B spilled"
    cases = [("baseline", 64, (128, 64, 8, 3)), ("baseline", 128, (128, 64, 8, 3)),
             ("tma", 64, (128, 64, 8, 3)), ("tma", 64, (128, 128, 8, 3)), ("tma", 128, (128, 64, 8, 3)),
             ("tma", 128, (128, 64, 8, 2)), ("tma_host", 64, (128, 64, 8, 3)), ("tma_host", 128, (128, 64, 8, 3)),
             ("heavy_first", 64, (128, 64, 8, 3)), ("heavy_first", 128, (128, 64, 8, 3)), ("heavy_lpt", 64, (128, 64, 8, 3)),
             ("tma_1loop", 64, (128, 64, 8, 3)), ("tma_1loop", 128, (128, 64, 8, 3)),
             ("tma_ws1", 64, (128, 64, 4, 3)), ("tma_ws1", 128, (128, 64, 4, 3)),
             ("tma_ws", 64, (128, 64, 4, 3)), ("tma_ws", 64, (128, 64, 8, 3)), ("tma_ws", 128, (128, 64, 4, 3)),
             ("tma_ws", 128, (128, 64, 8, 3))]
    print(f"triton {triton.__version__}")
    for kind, hd, (m, n, w, s) in cases:
        t0 = time.time()
        try:
            if kind == "baseline":
                from rtrainer.attention import flash_forward_kernel
                consts = dict(HEAD_DIM=hd, BLOCK_M=m, BLOCK_N=n, CAUSAL=True, PRECISION="tf32")
                c = compile_one(flash_forward_kernel, consts, w, s)
            elif kind.startswith("heavy"):
                consts = dict(HEAD_DIM=hd, BLOCK_M=m, BLOCK_N=n, LPT=kind == "heavy_lpt", PRECISION="tf32")
                c = compile_one(heavy_first_kernel, consts, w, s)
            else:
                one = kind in ("tma_1loop", "tma_ws1")
                consts = dict(HEAD_DIM=hd, BLOCK_M=m, BLOCK_N=n, WARP_SPEC=kind in ("tma_ws", "tma_ws1"), PER_HEAD=one,
                              ONE_LOOP=one, PRECISION="tf32")
                descs = {p: f"tensordesc<bf16[1,{rows},{hd}]>" for p, rows in zip("QKVO", (m, n, n, m))} if kind == "tma_host" else None
                c = compile_one(tma_forward_kernel, consts, w, s, descs)
            ws = "ttg.warp_specialize" in c.asm["ttgir"]        # the op that holds the partitions, not the loop attribute
            print(f"{kind:12s} hd{hd:<4d} {m}/{n} w{w} s{s}: shared {c.metadata.shared} B, {registers(c)}, {c.metadata.num_warps} warps, "
                  f"{'warp-specialized' if ws else 'not warp-specialized'}  ({time.time() - t0:.1f} s)", flush=True)
        except Exception as e: print(f"{kind:12s} hd{hd:<4d} {m}/{n} w{w} s{s}: FAILED {one_line(e)}  ({time.time() - t0:.1f} s)", flush=True)

if __name__ == "__main__":
    if "--cpu-check" in sys.argv: cpu_check()
    elif "--compile-check" in sys.argv: compile_check()
    elif not torch.cuda.is_available(): sys.exit("attention_variants: needs a CUDA GPU (or --cpu-check / --compile-check)")
    else: gpu_main()
