"""A head-dim-64 backward in one kernel: the pipelined dK/dV of rtrainer.attention_hopper that also adds each key
block's share of dQ, dS K, into an fp32 buffer by TMA reduce-add, checked and timed against the package's two kernels.

Why: the package's backward runs dQ and dK/dV as two kernels. Both form the scores and dP, so they issue seven matmul
products per key/query block pair where one kernel needs five: Sᵀ, dPᵀ, dV += Pᵀ dO, dK += dSᵀ Q and dQ += dS K. At
T 8192, head dim 64, that is why it trails cuDNN (experiments/attention_ws.md, round 18). The cost of one kernel is
traffic: each consumer adds a (64 queries, 64) fp32 block into dQ per step, 4 bytes per score, where the two kernels
read Q, dO, K and V once more. experiments/tma_reduce.py checks the reduce-add copy this needs.

Per consumer and step: dSᵀ (keys x queries, bf16) goes to shared memory (two buffers), where dK += dSᵀ Q reads it;
the next block's turn starts with dQ_part = dS K (dS read transposed, K this consumer's tile), waits for it alone, and
adds its fp32 result by `async_reduce_add` from a shared buffer before the block's dV and dK products. δ = rowsum(dO ∘ O) comes from a small kernel that also zeroes the
fp32 dQ buffer; a last kernel scales dQ and converts it to bf16.

`python experiments/attention_dq_fused.py --compile` compiles the kernel for sm_90 without a GPU. On a GPU it runs a
small launch in a child with a time limit (an mbarrier mistake hangs), checks dQ, dK and dV against float64 at odd
shapes, then times the backward (fused against the package's two kernels) and forward + backward (against cuDNN),
alternated (ROUNDS), at head-dim-64 shapes (FUSED_SHAPES); writes $OUT/attention_dq_fused.json, a short table last.

Measured on an H100 (experiments/attention_dq_fused.md): right, but 0.90x to 0.99x of the two kernels from T 2048 and
0.73x at rb100m. This is an experiment, not part of rtrainer."""
import json, math, os, statistics, subprocess, sys, time
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tma_reduce import async_reduce_add
from rtrainer.attention_hopper import (_barriers, _take_turn, _sectioned, _ordered, _dkdv_loader, _dkdv_rows, _dkdv_p, _dkdv_ds, _dkdv_store,
                                       _descriptor, _plan, _sm_count, LOADER_REGS, CONSUMER_REGS, LOG2E)
from rtrainer.kernels import launch

ROUNDS = int(os.environ.get("ROUNDS", 5))
TILES = (64, 64, 3)           # keys per consumer, query rows per ring slot, ring slots: the package's head-dim-64 dK/dV tile
SHAPES = [s for s in os.environ.get("FUSED_SHAPES", "T2048,T4096,T8192,rb100m,moe4b").split(",") if s]
CHECK_CASES = ((2, 1000, 12, 4, 64), (1, 900, 4, 2, 64), (1, 1, 4, 2, 64), (2, 513, 6, 6, 64), (1, 4099, 4, 2, 64))
SMOKE_TIMEOUT_S = int(os.environ.get("SMOKE_TIMEOUT_S", 240))

@gluon.jit
def _operands(sT, dpT, lse2, delta, qi, start_n, k_pos, p_layout: gl.constexpr, BLOCK_N: gl.constexpr,
              BLOCK_M: gl.constexpr, scale_log2):
    "Pᵀ as the register operand of dV += Pᵀ dO, and dSᵀ in bf16 for shared memory, where dK += dSᵀ Q and dQ += dS K read it."
    pT = _dkdv_p(sT, lse2, qi, start_n, k_pos, scale_log2, BLOCK_N, BLOCK_M)
    return gl.convert_layout(pT.to(gl.bfloat16), p_layout), _dkdv_ds(pT, dpT, delta).to(gl.bfloat16)

@gluon.jit
def _add_dq(dq, dq_smem, dq_desc, row, col):
    "A block's dQ share into the fp32 buffer: once the last reduce has left dq_smem, store, fence, reduce-add."
    tma.store_wait(0)
    dq_smem.store(dq)
    fence_async_shared()                              # also orders the last dSᵀ store before the dQ product that reads it
    async_reduce_add(dq_desc, [row, col], dq_smem)

@gluon.jit
def _fused_head(base, it, first_i, n_i, start_n, k_pos, k_op, v_op, k_tile, q_smem, do_smem, ds_smem, dq_smem, dq_desc,
                q_bar, do_bar, free_bar, turn_bar, dk, dv, zero_s, zero_q, LSE, DELTA, b, kvh, H, T, GROUP, scale_log2,
                row_layout: gl.constexpr, p_layout: gl.constexpr, C: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, EARLY_TURN: gl.constexpr):
    """attention_hopper._dkdv_head with dQ. A block's dQ_part = dS K (dSᵀ from shared memory, two buffers by the
    block's parity) is issued first in the next block's turn, ahead of that block's score products; it is waited for,
    and reduce-added into dQ, before the block's own dV and dK products are issued. So no product is in flight across
    steps, and while Pᵀ and dSᵀ are formed only dV and dK are, as in the package's kernel. EARLY_TURN ends the turn
    after the score products, so that the other consumer issues while this one waits for dQ and adds it."""
    other = turn_bar.index(1 - C)
    skips = gl.minimum(gl.maximum(start_n // BLOCK_M - first_i, 0), n_i)
    for u in range(base, base + skips):
        _take_turn(turn_bar, it + u, C)
        mbarrier.arrive(other, count=1)
        slot = (it + u) % STAGES
        mbarrier.wait(q_bar.index(slot), ((it + u) // STAGES) & 1)
        mbarrier.wait(do_bar.index(slot), ((it + u) // STAGES) & 1)
        mbarrier.arrive(free_bar.index(slot), count=1)
    if skips < n_i:
        row0 = b * T
        col = (kvh * GROUP + base // n_i) * HEAD_DIM   # this head's dQ columns
        u = base + skips
        prev = (it + u) % STAGES
        phase = ((it + u) // STAGES) & 1
        qi_prev = first_i + skips
        lse2, delta = _dkdv_rows(LSE, DELTA, u, first_i, n_i, b, kvh, H, T, GROUP, row_layout, BLOCK_M)
        _take_turn(turn_bar, it + u, C)
        mbarrier.wait(q_bar.index(prev), phase)
        sT = warpgroup_mma(k_op, q_smem.index(prev).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(prev), phase)
        dpT = warpgroup_mma(v_op, do_smem.index(prev).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.arrive(other, count=1)
        sT, dpT = warpgroup_mma_wait(num_outstanding=0, deps=[sT, dpT])
        p_op, dsT = _operands(sT, dpT, lse2, delta, qi_prev, start_n, k_pos, p_layout, BLOCK_N, BLOCK_M, scale_log2)
        pb = 0
        ds_smem.index(pb).store(dsT)
        fence_async_shared()
        for u in range(base + skips + 1, base + n_i):
            slot = (it + u) % STAGES
            phase = ((it + u) // STAGES) & 1
            lse2, delta = _dkdv_rows(LSE, DELTA, u, first_i, n_i, b, kvh, H, T, GROUP, row_layout, BLOCK_M)
            _take_turn(turn_bar, it + u, C)
            dq = warpgroup_mma(ds_smem.index(pb).permute((1, 0)), k_tile, zero_q, use_acc=False, is_async=True)
            mbarrier.wait(q_bar.index(slot), phase)
            sT = warpgroup_mma(k_op, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            mbarrier.wait(do_bar.index(slot), phase)
            dpT = warpgroup_mma(v_op, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if EARLY_TURN:
                mbarrier.arrive(other, count=1)
            dq = warpgroup_mma_wait(num_outstanding=2, deps=[dq])
            _add_dq(dq, dq_smem, dq_desc, row0 + qi_prev * BLOCK_M, col)
            dv = warpgroup_mma(p_op, do_smem.index(prev), dv, is_async=True)
            dk = warpgroup_mma(ds_smem.index(pb), q_smem.index(prev), dk, is_async=True)
            if not EARLY_TURN:
                mbarrier.arrive(other, count=1)
            sT, dpT = warpgroup_mma_wait(num_outstanding=2, deps=[sT, dpT])
            qi = first_i + u - base
            p_op, dsT = _operands(sT, dpT, lse2, delta, qi, start_n, k_pos, p_layout, BLOCK_N, BLOCK_M, scale_log2)
            ds_smem.index(1 - pb).store(dsT)          # its readers, the block before last's dK and dQ products, are done
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
            mbarrier.arrive(free_bar.index(prev), count=1)
            fence_async_shared()
            prev, pb, qi_prev = slot, 1 - pb, qi
        dv = warpgroup_mma(p_op, do_smem.index(prev), dv, is_async=True)
        dk = warpgroup_mma(ds_smem.index(pb), q_smem.index(prev), dk, is_async=True)
        dq = warpgroup_mma(ds_smem.index(pb).permute((1, 0)), k_tile, zero_q, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, dq])
        mbarrier.arrive(free_bar.index(prev), count=1)
        _add_dq(dq, dq_smem, dq_desc, row0 + qi_prev * BLOCK_M, col)
    return dk, dv

@gluon.jit
def _fused_consumer(k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, out_smem, dk_desc, dv_desc, dq_desc, kv_bar, kv_free,
                    q_bar, do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP,
                    BKV, HEADS, ORDER, n_pairs, scale_log2, sm_scale, C: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, TABLE: gl.constexpr,
                    EARLY_TURN: gl.constexpr):
    "attention_hopper._dkdv_consumer, pipelined, with `_fused_head`: dK and dV leave by its `_dkdv_store`, dQ by reduce-add."
    NW: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    kv_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, a_layout)
    k_tile = k_smem.index(C)
    v_tile = v_smem.index(C)
    it = 0
    tc = 0
    for t in range(gl.program_id(0), n_pairs * BKV, gl.num_programs(0)):
        p, bkv = _sectioned(_ordered(t, ORDER, TABLE), n_pairs, BKV, HEADS)
        pair_n = p * 2 * BLOCK_N
        start_n = pair_n + C * BLOCK_N
        b = bkv // KV
        kvh = bkv % KV
        first_i = pair_n // BLOCK_M
        n_i = gl.cdiv(T, BLOCK_M) - first_i
        k_pos = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, s_layout))
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
        mbarrier.wait(kv_bar.index(C), tc & 1)
        k_op = k_tile.load(kv_layout)
        v_op = v_tile.load(kv_layout)
        for g in range(GROUP):
            dk, dv = _fused_head(g * n_i, it, first_i, n_i, start_n, k_pos, k_op, v_op, k_tile, q_smem, do_smem, ds_smem,
                                 dq_smem, dq_desc, q_bar, do_bar, free_bar, turn_bar, dk, dv, zero_s, zero_q, LSE, DELTA,
                                 b, kvh, H, T, GROUP, scale_log2, row_layout, p_layout, C, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES,
                                 EARLY_TURN)
        mbarrier.arrive(kv_free.index(C), count=1)    # the dQ products that read K have completed
        _dkdv_store(dk, dv, out_smem, dk_desc, dv_desc, DK, DV, stride_dkb, stride_dkt, stride_dkh, b, kvh, start_n, T,
                    sm_scale, a_layout, HEAD_DIM, BLOCK_N)
        it += GROUP * n_i
        tc += 1
    tma.store_wait(0)

@gluon.jit
def fused_backward_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LSE, DELTA, DK, DV, stride_dkb,
                          stride_dkt, stride_dkh, H, KV, T, GROUP, BKV, HEADS, ORDER, n_pairs, scale_log2, sm_scale,
                          HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                          TABLE: gl.constexpr, EARLY_TURN: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    "hopper_dkdv_kernel's program with `_fused_consumer`: per consumer two dSᵀ buffers and one fp32 dQ buffer more."
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], gl.bfloat16)
    ds0 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_M], ds_layout)
    ds1 = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq0 = gl.allocate_shared_memory(dq_desc.dtype, [BLOCK_M, HEAD_DIM], dq_desc.layout)
    dq1 = gl.allocate_shared_memory(dq_desc.dtype, [BLOCK_M, HEAD_DIM], dq_desc.layout)
    out0 = gl.allocate_shared_memory(dk_desc.dtype, [2, BLOCK_N, HEAD_DIM], dk_desc.layout)
    out1 = gl.allocate_shared_memory(dk_desc.dtype, [2, BLOCK_N, HEAD_DIM], dk_desc.layout)
    kv_bar = _barriers(2, 1)
    kv_free = _barriers(2, 1)
    q_bar = _barriers(STAGES, 1)
    do_bar = _barriers(STAGES, 1)
    free_bar = _barriers(STAGES, 2)
    turn_bar = _barriers(2, 1)
    gl.warp_specialize([
        (_fused_consumer, (k_smem, v_smem, q_smem, do_smem, ds0, dq0, out0, dk_desc, dv_desc, dq_desc, kv_bar, kv_free, q_bar,
                           do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP,
                           BKV, HEADS, ORDER, n_pairs, scale_log2, sm_scale, 0, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, TABLE,
                           EARLY_TURN)),
        (_fused_consumer, (k_smem, v_smem, q_smem, do_smem, ds1, dq1, out1, dk_desc, dv_desc, dq_desc, kv_bar, kv_free, q_bar,
                           do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP,
                           BKV, HEADS, ORDER, n_pairs, scale_log2, sm_scale, 1, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, TABLE,
                           EARLY_TURN)),
        # the loader without lse and δ (LOADER_ROWS False): Q's and dO's descriptors and buffers stand in for theirs, unread
        (_dkdv_loader, (q_desc, k_desc, v_desc, do_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, q_smem, do_smem,
                        kv_bar, kv_free, q_bar, do_bar, free_bar, KV, T, GROUP, BKV, HEADS, ORDER, n_pairs, HEAD_DIM, BLOCK_N,
                        BLOCK_M, STAGES, TABLE, False)),
    ], [4, 1], [REGS, LOADER_REGS])

@triton.jit
def delta_kernel(O, DO, DELTA, DQ_ACC, T, H, stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh,
                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    "δ = rowsum(dO ∘ O) of BLOCK rows of one (batch, head), (B,H,T) fp32; the same rows of the fp32 dQ buffer set to zero."
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows < T
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_ot + cols[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows[:, None] * stride_dt + cols[None, :], mask=ok[:, None], other=0.0)
    tl.store(DELTA + bh.to(tl.int64) * T + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)
    acc = ((b * T + rows).to(tl.int64) * H + h)[:, None] * HEAD_DIM + cols[None, :]
    tl.store(DQ_ACC + acc, tl.zeros([BLOCK, HEAD_DIM], tl.float32), mask=ok[:, None])

@triton.jit
def finish_kernel(DQ_ACC, DQ, n, scale, BLOCK: tl.constexpr):
    "dQ = scale · the fp32 buffer, in bf16."
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(DQ + at, (tl.load(DQ_ACC + at, mask=at < n) * scale).to(tl.bfloat16), mask=at < n)

def _fp32_descriptor(t, rows, hd):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, hd],
                            gl.NVMMASharedLayout.get_default_for([rows, hd], gl.float32))

def fused_backward(do, q, k, v, o, lse, tiles=TILES, early_turn=False):
    "(dq, dk, dv) of causal attention, head dim 64, by δ, the fused kernel and the dQ conversion; do, o contiguous."
    B, T, H, hd = q.shape
    KV = k.shape[2]
    block_n, block_m, stages = tiles
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    dq_acc = torch.empty(B * T, H * hd, dtype=torch.float32, device=q.device)
    dk = torch.empty(B, T, KV, hd, dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    launch(delta_kernel, (triton.cdiv(T, 64), B * H), o, do, delta, dq_acc, T, H, *o.stride()[:3], *do.stride()[:3], HEAD_DIM=hd, BLOCK=64)
    n_pairs = triton.cdiv(T, 2 * block_n)
    programs = min(n_pairs * B * KV, _sm_count(q.device.index))
    width, table = _plan("dkdv", B, T, H, KV, hd, n_pairs, programs, q.device)
    launch(fused_backward_kernel, (programs,),
           _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
           _descriptor(dk, block_n), _descriptor(dv, block_n), _fp32_descriptor(dq_acc, block_m, hd), lse, delta, dk, dv,
           *dk.stride()[:3], H, KV, T, H // KV, B * KV, width, lse if table is None else table, n_pairs, LOG2E / hd ** 0.5,
           1.0 / hd ** 0.5, HEAD_DIM=hd, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, TABLE=table is not None,
           EARLY_TURN=early_turn, REGS=CONSUMER_REGS, num_warps=4)
    dq = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    launch(finish_kernel, (triton.cdiv(dq.numel(), 4096),), dq_acc, dq, dq.numel(), 1.0 / hd ** 0.5, BLOCK=4096)
    return dq, dk, dv

VARIANTS = {"fused": False, "fused early turn": True}   # arm: EARLY_TURN (measured on an H100: "fused" only)

def compile_check():
    "Each variant compiled for sm_90 without a GPU: registers, spills, shared memory, wgmma and reduce instructions."
    from sm90_compile import compile_gluon_sm90
    bn, bm, stages = TILES
    descs = dict(q_desc=(bm, 64), do_desc=(bm, 64), k_desc=(bn, 64), v_desc=(bn, 64), dk_desc=(bn, 64), dv_desc=(bn, 64),
                 dq_desc=(bm, 64, "fp32"))
    for arm, early in VARIANTS.items():
        for table in (False, True):
            usage, smem, ptx = compile_gluon_sm90(fused_backward_kernel, dict(HEAD_DIM=64, BLOCK_N=bn, BLOCK_M=bm, STAGES=stages,
                                                                              TABLE=table, EARLY_TURN=early, REGS=CONSUMER_REGS,
                                                                              num_warps=4),
                                                  descs, 4, types=dict(LSE="*fp32", DELTA="*fp32", DK="*bf16", DV="*bf16",
                                                                       ORDER="*i32" if table else "*fp32"))
            print(f"{arm}, TABLE={table}: {usage}, shared {smem} B, wgmma {ptx.count('wgmma.mma_async')}, "
                  f"reduce {ptx.count('cp.reduce.async.bulk')}")
    return True

def _inputs(B, T, H, KV, hd, seed=1):
    from rtrainer.attention import fused_qkv_views, flash_attention_forward
    torch.manual_seed(seed)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_attention_forward(q, k, v, True)
    return q, k, v, do, o, lse

def smoke(arm):
    "One small launch of one variant (run in a child with a time limit)."
    q, k, v, do, o, lse = _inputs(1, 400, 4, 2, 64)
    fused_backward(do, q, k, v, o, lse, early_turn=VARIANTS[arm])
    torch.cuda.synchronize()
    print("SMOKE ok", flush=True)

def _smoked(arm):
    "{ok, note} of one variant's smoke run in a child process with a time limit (an mbarrier mistake hangs)."
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke", arm], capture_output=True, text=True,
                           timeout=SMOKE_TIMEOUT_S)
        return dict(ok="SMOKE ok" in p.stdout, note=p.stderr.strip()[-600:])
    except subprocess.TimeoutExpired:
        return dict(ok=False, note=f"hung: stopped after {SMOKE_TIMEOUT_S} s")

def check(case, arm):
    "Relative errors of one variant's dQ, dK, dV against float64 autograd."
    from rtrainer.attention import relative_error, attention_reference
    q, k, v, do, o, lse = _inputs(*case)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(attention_reference(q64, k64, v64, True), (q64, k64, v64), do.double())
    got = fused_backward(do, q, k, v, o, lse, early_turn=VARIANTS[arm])
    return {name: relative_error(g, w) for name, g, w in zip(("dq", "dk", "dv"), got, want)}

def gpu_main():
    from attention_gluon import _alternate, _ratios
    from attention_configs import shape_dims
    from rtrainer.attention import flash_attention_forward, flash_attention_backward, attention_flops
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, commit=os.environ.get("RTRAINER_COMMIT", ""), tiles=TILES, rounds=ROUNDS,
                   smoke={}, checks=[], rows=[])
    passed = []
    for arm in VARIANTS:
        payload["smoke"][arm] = _smoked(arm)
        print("smoke", arm, payload["smoke"][arm], flush=True)
        ok = payload["smoke"][arm]["ok"]
        for case in CHECK_CASES if ok else ():
            row = dict(arm=arm, case=case, **check(case, arm))
            row["ok"] = all(math.isfinite(row[n]) and row[n] < 1e-2 for n in ("dq", "dk", "dv"))
            payload["checks"].append(row)
            print(row, flush=True)
            ok = ok and row["ok"]
        if ok: passed.append(arm)
    table = []
    for name in SHAPES if passed else ():
        B, H, KV, T, hd = shape_dims(name)
        q, k, v, do, o, lse = _inputs(B, T, H, KV, hd, seed=2)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k.repeat_interleave(H // KV, 2),
                                                                            v.repeat_interleave(H // KV, 2)))
        dot = do.transpose(1, 2)
        def cudnn_both():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            torch.autograd.grad(out, (qt, kt, vt), dot)
        flops = attention_flops(B, H, T, hd)
        arms = dict(two=lambda: flash_attention_backward(do, q, k, v, o, lse, True))
        arms.update({arm: lambda e=VARIANTS[arm]: fused_backward(do, q, k, v, o, lse, early_turn=e) for arm in passed})
        both = dict(rtrainer=lambda: flash_attention_backward(do, q, k, v, *flash_attention_forward(q, k, v, True), True))
        both.update({arm: lambda e=VARIANTS[arm]: fused_backward(do, q, k, v, *flash_attention_forward(q, k, v, True),
                                                                 early_turn=e) for arm in passed})
        both["cudnn"] = cudnn_both
        for kind, work, timed, base in (("backward", 2.5, arms, "two"), ("forward+backward", 3.5, both, "cudnn")):
            times = _alternate(timed, ROUNDS)
            med = {arm: statistics.median(t) for arm, t in times.items()}
            row = dict(shape=name, kernel=kind, ms=med, tflops={a: work * flops / m / 1e9 for a, m in med.items()},
                       **{f"{arm} vs {base}": _ratios(times, base, arm) for arm in timed if arm != base})
            payload["rows"].append(row)
            table.append((name, kind, row["tflops"], {k[:-len(base) - 4]: v for k, v in row.items() if k.endswith(f" vs {base}")}))
            print(name, kind, {a: round(x, 1) for a, x in row["tflops"].items()}, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_dq_fused.json"), "w") as f: json.dump(payload, f, indent=1)
    print("\nshape     kind              TFLOP/s by arm; each against two kernels (backward) or cuDNN (fwd+bwd) [95%]")
    for name, kind, tf, ratios in table:
        print(f"{name:9} {kind:17} " + ", ".join(f"{a} {x:.1f}" for a, x in tf.items()) + " ; "
              + ", ".join(f"{a} %.3f [%.3f, %.3f]" % r for a, r in ratios.items()))
    return bool(passed) and len(passed) == len(VARIANTS)

if __name__ == "__main__":
    if "--compile" in sys.argv: sys.exit(0 if compile_check() else 1)
    if not torch.cuda.is_available(): sys.exit("attention_dq_fused: needs a CUDA GPU (or --compile)")
    if "--smoke" in sys.argv: smoke(sys.argv[sys.argv.index("--smoke") + 1])
    else: sys.exit(0 if gpu_main() else 1)
