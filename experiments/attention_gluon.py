"""A causal flash-attention forward and dK/dV kernel in Gluon (Triton's lower-level language), waits placed by hand.

Why: rtrainer's Triton forward trails cuDNN most at head dim 128 (332 against 453 TFLOP/s at dense1b). Compiled
for sm_90, its key loop is: issue `S = Q Kᵀ`, wait for it (and for the previous `P V`), softmax, issue `P V`; the
tensor cores idle during the softmax unless the SM's other program fills the gap. Triton 3.6 keeps that order even
when the source computes the next block's scores early (`experiments/attention_ahead.py`). Gluon exposes the asynchronous
wgmma and its wait (`warpgroup_mma(is_async=True)`, `warpgroup_mma_wait(num_outstanding)`), TMA copies and
mbarriers, so the order is ours. Per key block j the loop here does:

    issue S_{j+1} = Q K_{j+1}ᵀ                      (K_{j+1} arrived by TMA)
    softmax of S_j                                   (overlaps S_{j+1} on the tensor cores)
    wait until at most one wgmma is in flight        (P V_{j-1} done; S_{j+1} may still run)
    rescale O, refill the ring slot P V_{j-1} freed  (TMA for block j + STAGES - 1)
    issue O += P_j V_j
    wait until at most one is in flight              (S_{j+1} done; P V_j may still run)

K and V blocks come through a ring of STAGES shared-memory slots filled by TMA; the last (diagonal) block is masked
after the loop. Q, K and V are read through 2-D TMA descriptors over (B*T, heads*hd), which needs the batch stride
to be T times the row stride (true of rtrainer's fused QKV views); rows past T in a block belong to the next batch
or are zero-filled, and the causal mask or the final store's row mask discards them. BLOCK_M == BLOCK_N.

The dQ and dK/dV kernels (below) apply the same idea to the backward: a step's two score products are issued
together and the exponentials run while the second is in flight, and the dQ (or dV and dK) products are left in
flight into the next step. Every variant first runs one small launch in a child process with a time limit, since
a mistake in the mbarrier phases hangs the GPU rather than failing.

This is an experiment, not part of rtrainer. Gluon has no interpreter, so the math is only checked on a GPU:
`python experiments/attention_gluon.py` checks the forward's output and log-sum-exp and the backward's dQ, δ, dK and dV against
float64 at odd shapes, then times each variant that passed against rtrainer's kernel (and the forward against
cuDNN), alternated, at the reference shapes (writes $OUT/attention_gluon.json). `python experiments/attention_gluon.py
--compile` compiles both for sm_90 on a machine without a GPU and prints registers, spills, shared memory and the
wgmma waits in their PTX."""
import json, os, re, statistics, subprocess, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_variants import reference                              # float64 (o, lse)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait

ROUNDS = 5
# head dim: variants (BLOCK_M = BLOCK_N, warps, stages). 64 x 64 with one warpgroup is the tile of rtrainer's kernel;
# 128 x 128 with two warpgroups (64 rows each) is FlashAttention-3's tile for head dim 128, one program per SM.
CONFIGS = {64: [(64, 4, 3), (128, 8, 3)], 128: [(64, 4, 3), (128, 8, 3)]}
# The forward needs STAGES >= 3: at block j it reads K_{j+1} and V_j while the TMA fills the slot of block j - 1.

@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j, row0, col, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    slot = j % STAGES
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + j * BLOCK_N, col], k_bar.index(slot), k_smem.index(slot))
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row0 + j * BLOCK_N, col], v_bar.index(slot), v_smem.index(slot))

@gluon.jit
def _ring(a_desc, b_desc, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    "Two rings of STAGES (ROWS, HEAD_DIM) shared-memory tiles, filled by TMA from a_desc and b_desc, and their mbarriers."
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, ROWS, HEAD_DIM], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, ROWS, HEAD_DIM], b_desc.layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_bar.index(i), count=1)
        mbarrier.init(b_bar.index(i), count=1)
    return a_smem, b_smem, a_bar, b_bar

@gluon.jit
def _release(a_bar, b_bar, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(a_bar.index(i))
        mbarrier.invalidate(b_bar.index(i))

@gluon.jit
def _query_program(H, GROUP):
    "This program's query block index, batch, query head and KV head (grid: query blocks x B*H)."
    bh = gl.program_id(1)
    return gl.program_id(0), bh // H, bh % H, (bh % H) // GROUP

@gluon.jit
def _online_softmax(s, m_i, l_i, scale_log2):
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    p = gl.exp2(s * scale_log2 - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

@gluon.jit
def gluon_forward_kernel(q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_ot, stride_oh, H, T, GROUP, scale_log2,
                         HEAD_DIM: gl.constexpr, BLOCK: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    pid_m, b, h, kvh = _query_program(H, GROUP)
    start_m = pid_m * BLOCK
    row0 = b * T                                     # this batch's first row in the (B*T, heads*hd) views
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_bar, v_bar = _ring(k_desc, v_desc, BLOCK, HEAD_DIM, STAGES)

    n = pid_m + 1                                    # key blocks 0 .. pid_m; the last is the diagonal one
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0 + start_m, h * HEAD_DIM], q_bar, q_smem)
    for i in gl.static_range(STAGES - 1):
        if i < n:
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, i, row0, kvh * HEAD_DIM, BLOCK, STAGES)

    m_i = gl.full([BLOCK], -1.0e30, gl.float32, s_rows)
    l_i = gl.zeros([BLOCK], gl.float32, s_rows)
    acc = warpgroup_mma_init(gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout))   # carried through the loop in flight
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])

    for j in range(0, n - 1):                        # full key blocks; block j + 1 exists
        nxt = (j + 1) % STAGES
        mbarrier.wait(k_bar.index(nxt), ((j + 1) // STAGES) & 1)
        s_next = warpgroup_mma(q_smem, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])                    # P V_{j-1} done
        if j + STAGES - 1 < n:                       # its slot is free now: prefetch block j + STAGES - 1
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j + STAGES - 1, row0, kvh * HEAD_DIM, BLOCK, STAGES)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
        cur = j % STAGES
        mbarrier.wait(v_bar.index(cur), (j // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(cur), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_next])                   # S_{j+1} done, P V_j may run on

    # the diagonal block n - 1 = pid_m: mask above the diagonal, then the same step
    q_pos = start_m + gl.arange(0, BLOCK, s_rows)
    k_pos = start_m + gl.arange(0, BLOCK, s_cols)
    s = gl.where(gl.expand_dims(q_pos, 1) >= gl.expand_dims(k_pos, 0), s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    last = (n - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n - 1) // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.invalidate(q_bar)
    _release(k_bar, v_bar, STAGES)

    acc = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    rows = start_m + gl.arange(0, BLOCK, o_rows)
    cols = gl.arange(0, HEAD_DIM, o_cols)
    o_ptrs = O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + gl.expand_dims(rows, 1) * stride_ot + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
    gl.store(LSE + (b * H + h).to(gl.int64) * T + q_pos, (m_i + gl.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

def _layout(block_shape):
    return gl.NVMMASharedLayout.get_default_for(block_shape, gl.bfloat16)

def _descriptor(x, block):
    "2-D TMA descriptor over (B*T, heads*hd) of a (B, T, heads, hd) view whose batch stride is T row strides."
    B, T, heads, hd = x.shape
    if x.stride(3) != 1 or x.stride(2) != hd or x.stride(0) != T * x.stride(1):
        raise ValueError(f"attention_gluon: needs rows of heads*hd contiguous values, batch stride T*row stride; got strides {x.stride()}")
    return TensorDescriptor(x, [B * T, heads * hd], [x.stride(1), 1], [block, hd], _layout([block, hd]))

def gluon_forward(q, k, v, variant=0):
    "Causal forward, bf16: (o, lse) like rtrainer's flash_attention_forward; `variant` indexes CONFIGS[head dim]."
    B, T, H, hd = q.shape
    block, warps, stages = CONFIGS[hd][variant]
    if stages < 3: raise ValueError(f"attention_gluon: the forward needs at least 3 stages, got {stages}")
    o = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    gluon_forward_kernel[(triton.cdiv(T, block), B * H)](
        _descriptor(q, block), _descriptor(k, block), _descriptor(v, block), o, lse, *o.stride()[:3], H, T, H // k.shape[2],
        1.4426950408889634 / hd ** 0.5, HEAD_DIM=hd, BLOCK=block, STAGES=stages, num_warps=warps)
    return o, lse

# ---- dK/dV: the same idea in the backward ---------------------------------------------------------------------------
# One program per block of BLOCK_N keys (one warpgroup), over every query block at or after the diagonal and every
# query head of the KV head's group, flattened into one loop of steps. Per step u (query block Q_u, dO_u):
#     issue Sᵀ_u = K Q_uᵀ and dPᵀ_u = V dO_uᵀ
#     wait until at most one wgmma is in flight     (dV, dK of step u-1 and Sᵀ_u done; dPᵀ_u may run)
#     refill the ring slot step u-1 freed; Pᵀ = exp2(Sᵀ·scale − lse)  (overlaps dPᵀ_u)
#     issue dV += Pᵀ dO_u
#     wait until at most one is in flight           (dPᵀ_u done; dV may run)
#     dSᵀ = Pᵀ ∘ (dPᵀ − δ); issue dK += dSᵀ Q_u      (both left in flight into the next step)
DKDV_CONFIGS = {64: [(64, 64, 4, 3)], 128: [(64, 32, 4, 3), (64, 64, 4, 2)]}   # head dim: variants (BLOCK_N, BLOCK_M, warps, stages)

@gluon.jit
def _load_q_do(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, u, n_i, first_i, row0, kvh, GROUP,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    slot = u % STAGES
    h = kvh * GROUP + u // n_i
    row = row0 + (first_i + u % n_i) * BLOCK_M
    mbarrier.expect(q_bar.index(slot), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, h * HEAD_DIM], q_bar.index(slot), q_smem.index(slot))
    mbarrier.expect(do_bar.index(slot), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [row, h * HEAD_DIM], do_bar.index(slot), do_smem.index(slot))

@gluon.jit
def gluon_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh,
                      H, KV, T, GROUP, scale_log2, sm_scale,
                      HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      num_warps: gl.constexpr):
    start_n = gl.program_id(0) * BLOCK_N
    bkv = gl.program_id(1)
    b = bkv // KV
    kvh = bkv % KV
    row0 = b * T
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    q_smem, do_smem, q_bar, do_bar = _ring(q_desc, do_desc, BLOCK_M, HEAD_DIM, STAGES)

    first_i = start_n // BLOCK_M                     # the first query block that sees these keys (BLOCK_M divides BLOCK_N)
    n_i = gl.cdiv(T, BLOCK_M) - first_i              # query blocks per head
    steps = GROUP * n_i
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + start_n, kvh * HEAD_DIM], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + start_n, kvh * HEAD_DIM], kv_bar, v_smem)
    for i in gl.static_range(STAGES - 1):
        if i < steps:
            _load_q_do(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, i, n_i, first_i, row0, kvh, GROUP, HEAD_DIM, BLOCK_M, STAGES)

    k_pos = start_n + gl.arange(0, BLOCK_N, key_rows)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout))
    mbarrier.wait(kv_bar, 0)
    for u in range(0, steps):
        slot = u % STAGES
        phase = (u // STAGES) & 1
        g = u // n_i
        qi = first_i + u % n_i
        mbarrier.wait(q_bar.index(slot), phase)
        sT = warpgroup_mma(k_smem, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(slot), phase)
        dpT = warpgroup_mma(v_smem, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dv, dk, sT = warpgroup_mma_wait(num_outstanding=1, deps=[dv, dk, sT])
        if u + STAGES - 1 < steps:                   # step u-1's slot is free: prefetch step u + STAGES - 1
            _load_q_do(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, u + STAGES - 1, n_i, first_i, row0, kvh, GROUP,
                       HEAD_DIM, BLOCK_M, STAGES)
        q_pos = qi * BLOCK_M + gl.arange(0, BLOCK_M, query_cols)
        head = (b * H + kvh * GROUP + g).to(gl.int64) * T
        lse2 = gl.load(LSE + head + q_pos, mask=q_pos < T, other=float("inf")) * 1.4426950408889634   # rows past T: P = 0
        delta = gl.load(DELTA + head + q_pos, mask=q_pos < T, other=0.0)
        pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse2, 0))
        if qi * BLOCK_M < start_n + BLOCK_N:         # a query block that overlaps the diagonal
            pT = gl.where(gl.expand_dims(q_pos, 0) >= gl.expand_dims(k_pos, 1), pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(gl.bfloat16), p_layout), do_smem.index(slot), dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=[dpT])
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        dk = warpgroup_mma(gl.convert_layout(dsT.to(gl.bfloat16), p_layout), q_smem.index(slot), dk, is_async=True)
    dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
    mbarrier.invalidate(kv_bar)
    _release(q_bar, do_bar, STAGES)
    rows = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, a_layout))
    out = b.to(gl.int64) * stride_dkb + kvh.to(gl.int64) * stride_dkh + gl.expand_dims(rows, 1) * stride_dkt + gl.expand_dims(cols, 0)
    gl.store(DK + out, (dk * sm_scale).to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
    gl.store(DV + out, dv.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)

def gluon_dkdv(do, q, k, v, lse, delta, variant=0):
    "dK, dV (B,T,KV,hd) of the causal attention, from the forward's lse and delta = rowsum(dO * O) (fp32, (B,H,T))."
    B, T, H, hd = q.shape
    KV = k.shape[2]
    block_n, block_m, warps, stages = DKDV_CONFIGS[hd][variant]
    dk = torch.empty(B, T, KV, hd, dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    gluon_dkdv_kernel[(triton.cdiv(T, block_n), B * KV)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
        lse, delta, dk, dv, *dk.stride()[:3], H, KV, T, H // KV, 1.4426950408889634 / hd ** 0.5, 1.0 / hd ** 0.5,
        HEAD_DIM=hd, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, num_warps=warps)
    return dk, dv

# ---- dQ: one program per query block, over the key blocks up to the diagonal ------------------------------------------
# Per key block j:  issue S_j = Q K_jᵀ and dP_j = dO V_jᵀ;  wait until one is in flight (dQ of block j-1 and S_j done);
# refill the freed slot; P = exp2(S·scale − lse) while dP_j runs;  wait for dP_j;  dS = P ∘ (dP − δ);  issue dQ += dS K_j.
# δ = rowsum(dO ∘ O) is computed here, as in rtrainer's dQ kernel, and stored for the dK/dV kernel.
DQ_CONFIGS = {64: [(64, 64, 4, 3)], 128: [(64, 64, 4, 3), (64, 32, 4, 3)]}   # head dim: variants (BLOCK_M, BLOCK_N, warps, stages)

@gluon.jit
def _tile_ptrs(base, b, h, rows, cols, stride_b, stride_t, stride_h):
    return base + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h + gl.expand_dims(rows, 1) * stride_t + gl.expand_dims(cols, 0)

@gluon.jit
def gluon_dq_kernel(k_desc, v_desc, Q, O, DO, LSE, DELTA, DQ, stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
                    stride_dob, stride_dot, stride_doh, stride_dqb, stride_dqt, stride_dqh, H, T, GROUP, scale_log2, sm_scale,
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    num_warps: gl.constexpr):
    pid_m, b, h, kvh = _query_program(H, GROUP)
    start_m = pid_m * BLOCK_M
    row0 = b * T
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    q_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    k_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)

    # Q and dO: loaded once with pointers into shared memory (they are wgmma operands); δ from dO and O in registers
    rows = start_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, load_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, load_layout))
    inside = gl.expand_dims(rows, 1) < T
    q_tile = gl.load(_tile_ptrs(Q, b, h, rows, cols, stride_qb, stride_qt, stride_qh), mask=inside, other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], smem_layout, q_tile)
    do_tile = gl.load(_tile_ptrs(DO, b, h, rows, cols, stride_dob, stride_dot, stride_doh), mask=inside, other=0.0)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, HEAD_DIM], smem_layout, do_tile)
    o_tile = gl.load(_tile_ptrs(O, b, h, rows, cols, stride_ob, stride_ot, stride_oh), mask=inside, other=0.0)
    delta_rows = gl.sum(o_tile.to(gl.float32) * do_tile.to(gl.float32), axis=1)
    gl.store(DELTA + (b * H + h).to(gl.int64) * T + rows, delta_rows, mask=rows < T)
    fence_async_shared()                             # the generic-proxy stores above, before wgmma reads them

    k_smem, v_smem, k_bar, v_bar = _ring(k_desc, v_desc, BLOCK_N, HEAD_DIM, STAGES)
    n = gl.cdiv(gl.minimum(start_m + BLOCK_M, T), BLOCK_N)   # key blocks up to the diagonal
    for i in gl.static_range(STAGES - 1):
        if i < n:
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, i, row0, kvh * HEAD_DIM, BLOCK_N, STAGES)

    q_pos = start_m + gl.arange(0, BLOCK_M, q_rows)
    lse2 = gl.load(LSE + (b * H + h).to(gl.int64) * T + q_pos, mask=q_pos < T, other=float("inf")) * 1.4426950408889634
    delta = gl.convert_layout(delta_rows, q_rows)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, a_layout))
    for j in range(0, n):
        slot = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_bar.index(slot), phase)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(slot), phase)
        dp = warpgroup_mma(do_smem, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dq, s = warpgroup_mma_wait(num_outstanding=1, deps=[dq, s])
        if j + STAGES - 1 < n:                       # block j-1's slot is free: prefetch block j + STAGES - 1
            _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, j + STAGES - 1, row0, kvh * HEAD_DIM, BLOCK_N, STAGES)
        p = gl.exp2(s * scale_log2 - gl.expand_dims(lse2, 1))
        if (j + 1) * BLOCK_N > start_m:              # a key block that reaches the diagonal
            k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, k_cols)
            p = gl.where(gl.expand_dims(q_pos, 1) >= gl.expand_dims(k_pos, 0), p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=[dp])
        ds = p * (dp - gl.expand_dims(delta, 1))
        dq = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), ds_layout), k_smem.index(slot), dq, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=[dq])
    _release(k_bar, v_bar, STAGES)
    out_rows = start_m + gl.arange(0, BLOCK_M, gl.SliceLayout(1, a_layout))
    out_cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, a_layout))
    out = DQ + b.to(gl.int64) * stride_dqb + h.to(gl.int64) * stride_dqh + gl.expand_dims(out_rows, 1) * stride_dqt + gl.expand_dims(out_cols, 0)
    gl.store(out, (dq * sm_scale).to(gl.bfloat16), mask=gl.expand_dims(out_rows, 1) < T)

def gluon_dq(do, q, k, v, o, lse, variant=0):
    "(dq (B,T,H,hd), delta (B,H,T) fp32) of the causal attention, like rtrainer's flash_backward_dq."
    B, T, H, hd = q.shape
    block_m, block_n, warps, stages = DQ_CONFIGS[hd][variant]
    dq = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    do = do.contiguous()
    gluon_dq_kernel[(triton.cdiv(T, block_m), B * H)](
        _descriptor(k, block_n), _descriptor(v, block_n), q, o, do, lse, delta, dq, *q.stride()[:3], *o.stride()[:3],
        *do.stride()[:3], *dq.stride()[:3], H, T, H // k.shape[2], 1.4426950408889634 / hd ** 0.5, 1.0 / hd ** 0.5,
        HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=warps)
    return dq, delta

def _compile_sm90(kernel, consts, descs, warps):
    "Compile a Gluon kernel for sm_90 without a GPU: (ptxas's register / spill line, shared memory, PTX)."
    from sm90_compile import compile_gluon_sm90
    types = dict(Q="*bf16", O="*bf16", DO="*bf16", DQ="*bf16", DK="*bf16", DV="*bf16", LSE="*fp32", DELTA="*fp32",
                 ORDER="*i32", scale_log2="fp32", sm_scale="fp32")      # ORDER: attention_hopper's dK/dV tile table
    (registers, spilled), shared, ptx = compile_gluon_sm90(kernel, consts, descs, warps, types)
    return f"{registers} registers, spills {spilled} bytes", shared, ptx

def _waits(ptx):
    return re.findall(r"wgmma.wait_group.sync.aligned (\d+)", ptx)

def compile_check():
    "Compile both kernels for sm_90 without a GPU; print registers, spills, shared memory and the PTX's wgmma waits."
    for hd, (block, warps, stages) in ((hd, c) for hd, cs in CONFIGS.items() for c in cs):
        regs, smem, ptx = _compile_sm90(gluon_forward_kernel, dict(HEAD_DIM=hd, BLOCK=block, STAGES=stages, num_warps=warps),
                                        {d: (block, hd) for d in ("q_desc", "k_desc", "v_desc")}, warps)
        print(f"forward hd {hd}, {block} x {block}, {warps} warps, {stages} stages: {regs}, shared memory {smem} bytes, "
              f"{ptx.count('wgmma.mma_async')} wgmma instructions, waits {_waits(ptx)}")
    for hd, (block_m, block_n, warps, stages) in ((hd, c) for hd, cs in DQ_CONFIGS.items() for c in cs):
        regs, smem, ptx = _compile_sm90(gluon_dq_kernel, dict(HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=warps),
                                        dict(k_desc=(block_n, hd), v_desc=(block_n, hd)), warps)
        print(f"dQ hd {hd}, {block_m} queries x {block_n} keys, {warps} warps, {stages} stages: {regs}, shared memory {smem} bytes, "
              f"{ptx.count('wgmma.mma_async')} wgmma instructions, waits {_waits(ptx)}")
    for hd, (block_n, block_m, warps, stages) in ((hd, c) for hd, cs in DKDV_CONFIGS.items() for c in cs):
        regs, smem, ptx = _compile_sm90(gluon_dkdv_kernel, dict(HEAD_DIM=hd, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, num_warps=warps),
                                        dict(q_desc=(block_m, hd), do_desc=(block_m, hd), k_desc=(block_n, hd), v_desc=(block_n, hd)), warps)
        print(f"dK/dV hd {hd}, {block_n} keys x {block_m} queries, {warps} warps, {stages} stages: {regs}, shared memory {smem} bytes, "
              f"{ptx.count('wgmma.mma_async')} wgmma instructions, waits {_waits(ptx)}")

def check(B, T, H, KV, hd, variant=0, device="cuda"):
    from rtrainer.attention import fused_qkv_views, relative_error
    torch.manual_seed(0)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, device)
    o, lse = gluon_forward(q, k, v, variant)
    ref_o, ref_lse = reference(q, k, v)
    return dict(B=B, T=T, H=H, KV=KV, hd=hd, variant=CONFIGS[hd][variant], o=relative_error(o, ref_o), lse=relative_error(lse, ref_lse))

def _backward_case(B, T, H, KV, hd, device="cuda"):
    "bf16 q, k, v, dO; rtrainer's forward o and lse; the float64 reference's (dq, dk, dv)."
    from rtrainer.attention import fused_qkv_views, attention_reference, flash_attention_forward
    torch.manual_seed(1)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, device)
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device=device)
    o, lse = flash_attention_forward(q, k, v, True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    return q, k, v, do, o, lse, torch.autograd.grad(attention_reference(q64, k64, v64, True), (q64, k64, v64), do.double())

def check_dkdv(B, T, H, KV, hd, variant=0):
    "dK, dV of the Gluon kernel against float64 autograd, from rtrainer's forward lse and delta = rowsum(dO * O)."
    from rtrainer.attention import relative_error
    q, k, v, do, o, lse, (_, ref_dk, ref_dv) = _backward_case(B, T, H, KV, hd)
    dk, dv = gluon_dkdv(do, q, k, v, lse, (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous(), variant)
    return dict(B=B, T=T, H=H, KV=KV, hd=hd, variant=DKDV_CONFIGS[hd][variant], dk=relative_error(dk, ref_dk), dv=relative_error(dv, ref_dv))

def check_dq(B, T, H, KV, hd, variant=0):
    "dQ and delta of the Gluon kernel against float64 autograd and rowsum(dO * O), from rtrainer's forward o and lse."
    from rtrainer.attention import relative_error
    q, k, v, do, o, lse, (ref_dq, _, _) = _backward_case(B, T, H, KV, hd)
    dq, delta = gluon_dq(do, q, k, v, o, lse, variant)
    return dict(B=B, T=T, H=H, KV=KV, hd=hd, variant=DQ_CONFIGS[hd][variant], dq=relative_error(dq, ref_dq),
                delta=relative_error(delta, (o.double() * do.double()).sum(-1).transpose(1, 2)))

def _ratios(times, base, arm):
    "(mean, low, high) of base time / arm time over the paired rounds: the arm's speed relative to base."
    from rtrainer.kernels import ratio_interval
    return ratio_interval([x / y for x, y in zip(times[base], times[arm])])

def _alternate(arms, rounds):
    from rtrainer.kernels import median_ms
    for fn in arms.values(): fn()
    times = {a: [] for a in arms}
    for r in range(rounds):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]): times[a].append(median_ms(arms[a]))
    return times

CHECK_CASES = ((2, 1000, 12, 4, 64), (1, 777, 16, 16, 128), (2, 257, 8, 1, 128), (1, 1, 4, 2, 64), (1, 4099, 4, 2, 64))

SMOKE_TIMEOUT_S = 150
KERNEL_CONFIGS = dict(forward=CONFIGS, dq=DQ_CONFIGS, dkdv=DKDV_CONFIGS)

def smoke(kind):
    "One small launch of every variant of one kernel (several key blocks, grouped heads), printing each that finished."
    from rtrainer.attention import fused_qkv_views, flash_attention_forward
    for hd, configs in KERNEL_CONFIGS[kind].items():
        q, k, v = fused_qkv_views(1, 400, 4, 2, hd, torch.bfloat16, "cuda")
        do = torch.randn_like(q)
        o, lse = flash_attention_forward(q, k, v, True)
        delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
        for variant in range(len(configs)):
            print(f"SMOKE {hd} {variant} started", flush=True)
            if kind == "forward": gluon_forward(q, k, v, variant)
            elif kind == "dq": gluon_dq(do, q, k, v, o, lse, variant)
            else: gluon_dkdv(do, q, k, v, lse, delta, variant)
            torch.cuda.synchronize()
            print(f"SMOKE {hd} {variant} ok", flush=True)

def _smoked(payload, kind):
    "Run `smoke(kind)` in a child process with a time limit (an mbarrier bug hangs the GPU); the (hd, variant) pairs that finished."
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke", kind], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
        out, note = r.stdout, "" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        out, note = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), f"hung: stopped after {SMOKE_TIMEOUT_S} s"
    done = {(int(hd), int(v)) for hd, v in re.findall(r"SMOKE (\d+) (\d+) ok", out)}
    started = re.findall(r"SMOKE (\d+) (\d+) started", out)
    culprit = started[-1] if started and (int(started[-1][0]), int(started[-1][1])) not in done else None
    payload["smoke"].append(dict(kernel=kind, finished=sorted(done), culprit=culprit, note=note))
    print(f"smoke {kind}: finished {sorted(done)}" + (f"; {note} at head dim {culprit[0]}, variant {culprit[1]}" if note else ""), flush=True)
    return done

def _checked(payload, kind, configs, check_fn, names):
    "Run check_fn on every case and variant; record the rows; return the (head dim, variant) pairs that passed all."
    alive = _smoked(payload, kind)
    for case in CHECK_CASES:
        hd = case[-1]
        for variant, config in enumerate(configs[hd]):
            if (hd, variant) not in alive:
                payload["checks"].append(dict(case=case, kernel=kind, hd=hd, variant=config, ok=False, error="smoke launch failed or hung"))
                continue
            try: row = check_fn(*case, variant)
            except Exception as e: row = dict(case=case, error=f"{type(e).__name__}: {str(e)[:300]}")
            row.update(kernel=kind, hd=hd, variant=config, ok=all(row.get(n, 1) < 1e-2 for n in names))
            payload["checks"].append(row)
            print(row, flush=True)
    return {(hd, c) for hd, cs in configs.items() for c in cs
            if all(r["ok"] for r in payload["checks"] if r["kernel"] == kind and r["hd"] == hd and r["variant"] == c)}

def gpu_main():
    from rtrainer.attention import (flash_attention_forward, flash_backward_dq, flash_backward_dkdv, fused_qkv_views, attention_flops,
                                    REFERENCE_ATTENTION_SHAPES)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   forward_configs={str(k): v for k, v in CONFIGS.items()}, dq_configs={str(k): v for k, v in DQ_CONFIGS.items()},
                   dkdv_configs={str(k): v for k, v in DKDV_CONFIGS.items()},
                   rounds=ROUNDS, smoke=[], checks=[], rows=[])
    forward_ok = _checked(payload, "forward", CONFIGS, check, ("o", "lse"))
    dq_ok = _checked(payload, "dq", DQ_CONFIGS, check_dq, ("dq", "delta"))
    dkdv_ok = _checked(payload, "dkdv", DKDV_CONFIGS, check_dkdv, ("dk", "dv"))
    for name in ("dense1b", "rb100m", "moe4b"):
        B, H, KV, T, hd = REFERENCE_ATTENTION_SHAPES[name]
        q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
        do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
        o, lse = flash_attention_forward(q, k, v, True)
        delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k.repeat_interleave(H // KV, 2), v.repeat_interleave(H // KV, 2)))
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        flops = attention_flops(B, H, T, hd)
        for kind, arms, passed, configs, work in (
                ("forward", {"rtrainer": lambda: flash_attention_forward(q, k, v, True), "cudnn": cudnn}, forward_ok, CONFIGS, flops),
                ("dq", {"rtrainer": lambda: flash_backward_dq(do, q, k, v, o, lse, True)}, dq_ok, DQ_CONFIGS, 1.5 * flops),   # three tile matmuls
                ("dkdv", {"rtrainer": lambda: flash_backward_dkdv(do, q, k, v, lse, delta, True)}, dkdv_ok, DKDV_CONFIGS, 2 * flops)):   # four
            for i, c in enumerate(configs[hd]):
                if (hd, c) not in passed: continue
                launch = dict(forward=lambda i=i: gluon_forward(q, k, v, i), dq=lambda i=i: gluon_dq(do, q, k, v, o, lse, i),
                              dkdv=lambda i=i: gluon_dkdv(do, q, k, v, lse, delta, i))[kind]
                arms["gluon " + "/".join(map(str, c))] = launch
            if len(arms) == (2 if kind == "forward" else 1): print(f"{name}: no {kind} variant passed its checks: not timed"); continue
            times = _alternate(arms, ROUNDS)
            row = dict(shape=name, kernel=kind, **{f"{a} ms": statistics.median(t) for a, t in times.items()},
                       **{f"{a} TFLOP/s": work / statistics.median(t) / 1e9 for a, t in times.items()})
            for arm in (a for a in arms if a.startswith("gluon")):
                row[f"{arm} speed vs rtrainer"] = _ratios(times, "rtrainer", arm)
                if "cudnn" in arms: row[f"{arm} speed vs cudnn"] = _ratios(times, "cudnn", arm)
            payload["rows"].append(row)
            print(f"{name:9} {kind:8} " + ", ".join(f"{a} {row[a + ' TFLOP/s']:.1f} TFLOP/s" for a in arms), flush=True)
            for arm in (a for a in arms if a.startswith("gluon")):
                print(f"{'':19}{arm} / rtrainer speed %.3f [%.3f, %.3f]" % row[f"{arm} speed vs rtrainer"], flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_gluon.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif "--smoke" in sys.argv: smoke(sys.argv[sys.argv.index("--smoke") + 1])
    elif not torch.cuda.is_available(): sys.exit("attention_gluon: needs a CUDA GPU (or --compile)")
    else: gpu_main()
