"""Warp-specialized flash attention in Gluon: a loader warp and two consumer warpgroups per program.

Why: at head dim 128 rtrainer's Triton kernels trail cuDNN (forward 336 against 459 TFLOP/s, backward 280 against
321 at dense1b). The Gluon kernels of `attention_gluon.py` placed the wgmma waits by hand in one warpgroup and lost;
what they lacked is the structure of the fastest Hopper kernels: one warp does nothing but issue TMA copies into a
ring of shared-memory slots, and two warpgroups, each owning its own rows, consume the slots. While one warpgroup
runs its softmax (or its exponentials and dS) on the ALUs, the other's wgmma keeps the tensor cores busy; the warp
scheduler does the interleaving, no wait placed by hand is needed for it.

Kernels (head dim 64 or 128, bf16, causal):
- forward: a program owns 2 x BLOCK_M query rows (one tile of BLOCK_M per consumer); the loader streams K and V blocks
  of BLOCK_N keys; each consumer runs the online softmax over its key blocks (the ones that reach its diagonal
  masked) and frees a slot when both have used it (an mbarrier of count 2).
- dK/dV: a program owns 2 x BLOCK_N keys (one tile per consumer); the loader streams Q, dO blocks (and their lse and
  δ rows) of every query head in the group from the first block that sees the keys.
- dQ: a program owns 2 x BLOCK_M query rows; the loader streams K and V blocks, as in the forward; δ comes from a
  small kernel of rtrainer's (`flash_backward_delta` if present) or from torch.

`python tests/attention_ws.py --compile` compiles every variant for sm_90 without a GPU (registers per partition
are what ptxas prints for the whole kernel; spills are the useful number). On a GPU it first runs each kernel's
variants once in a child process with a time limit (an mbarrier mistake hangs rather than fails), checks every
variant that finished against float64 at odd shapes, then times the passing ones against rtrainer's kernels and
cuDNN, alternated, at the reference shapes (writes $OUT/attention_ws.json; a short table last).

This is an experiment, not part of rtrainer."""
import json, math, os, re, statistics, subprocess, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma, mbarrier, fence_async_shared, warpgroup_mma, warpgroup_mma_wait
from attention_gluon import _compile_sm90, _alternate, _ratios, reference
# what went into the package (rtrainer.attention_hopper) is taken from there: the persistent forward ("persistent-kt"),
# the persistent dQ kernel ("persistent-t"), the dK/dV loader and the pieces they share; the plain "persistent" forward
# measured in rounds 3 to 6 is at commit c6ef687, the ping-pong dQ per query pair ("pp") at commit c8c90ab
from rtrainer.attention_hopper import (_barriers as _ring_barriers, _take_turn, _online_softmax, _load, _descriptor,
                                       hopper_forward_kernel, hopper_dq_kernel, _dkdv_loader as _dkdv_persistent_loader, _dkdv_rows)
import rtrainer.attention_hopper
rtrainer.attention_hopper.ENABLED = False     # the "rtrainer" arms below are the Triton kernels of rtrainer.attention

ROUNDS = 5
CONSUMER_WARPS = 4
from rtrainer.attention_hopper import LOADER_REGS
# variants: (BLOCK_M rows per consumer, BLOCK_N keys per slot, STAGES, registers per consumer thread, schedule)
FORWARD_CONFIGS = {64: [(64, 128, 3, 240, "persistent-kt")],
                   128: [(64, 128, 2, 240, "persistent-kt")]}
# schedule "ws": each consumer waits for its own matmuls; "pp": ping-pong, the consumers take turns to issue them;
# "ppk": ping-pong, a K slot freed as soon as its scores are done; "persistent-kt": the package's forward (ping-pong in one
# program per SM over all tiles, K freed early, the output stored by TMA from shared memory, overlapping the next tile)
# (BLOCK_N keys per consumer, BLOCK_M queries per slot, STAGES, registers)
# "persistent-tp": persistent-t with each step's lse and δ loaded during the step before; "persistent-te": loaded in
# the step, once its score products are issued (instead of after the first of them is done); "persistent-tc": a step
# ahead, held one value per thread until used (fewer live registers)
DKDV_CONFIGS = {64: [(64, 64, 2, 240, "persistent-tc")],
                128: [(64, 64, 2, 240, "persistent-tc"), (64, 64, 3, 240, "persistent-tc")]}
# (BLOCK_M rows per consumer, BLOCK_N keys per slot, STAGES, registers, schedule)
DQ_CONFIGS = {64: [(64, 64, 3, 240, "persistent-t")], 128: [(64, 64, 3, 240, "persistent-t")]}     # the package's kernel
LOG2E = 1.4426950408889634


# ---- forward ---------------------------------------------------------------------------------------------------------

@gluon.jit
def _query_pair(H, GROUP, BLOCK_M: gl.constexpr):
    "(first row of this program's 2 x BLOCK_M query rows, batch, query head, KV head); grid (query pairs, B*H)."
    bh = gl.program_id(1)
    return gl.program_id(0) * 2 * BLOCK_M, bh // H, bh % H, (bh % H) // GROUP

@gluon.jit
def _fwd_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, H, T, GROUP,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _fwd_loader_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, free_bar, H, T, GROUP,
                   HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)

@gluon.jit
def _fwd_loader_kv(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free, H, T, GROUP,
                   HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    "K's slot waits for k_free, V's for v_free (the same barriers unless the consumers free K as soon as S is done)."
    start_m, b, h, kvh = _query_pair(H, GROUP, BLOCK_M)
    row0 = b * T
    for c in gl.static_range(2):
        _load(q_desc, q_smem, q_bar, c, row0 + start_m + c * BLOCK_M, h * HEAD_DIM)
    n = gl.cdiv(gl.minimum(start_m + 2 * BLOCK_M, T), BLOCK_N)
    for j in range(n):
        slot = j % STAGES
        mbarrier.wait(k_free.index(slot), ((j // STAGES) & 1) ^ 1)     # a fresh barrier passes phase 1 at once
        _load(k_desc, k_smem, k_bar, slot, row0 + j * BLOCK_N, kvh * HEAD_DIM)
        mbarrier.wait(v_free.index(slot), ((j // STAGES) & 1) ^ 1)
        _load(v_desc, v_smem, v_bar, slot, row0 + j * BLOCK_N, kvh * HEAD_DIM)

@gluon.jit
def _fwd_step(j, q_tile, k_smem, v_smem, k_bar, v_bar, free_bar, acc, m_i, l_i, q_pos, zero_s, scale_log2,
              s_cols: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASK: gl.constexpr):
    slot = j % STAGES
    phase = (j // STAGES) & 1
    mbarrier.wait(k_bar.index(slot), phase)
    s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    if MASK:
        k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, s_cols)
        s = gl.where(gl.expand_dims(q_pos, 1) >= gl.expand_dims(k_pos, 0), s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    mbarrier.wait(v_bar.index(slot), phase)
    acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), p_layout), v_smem.index(slot), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(free_bar.index(slot), count=1)
    return acc, m_i, l_i

@gluon.jit
def _fwd_consumer(q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, O, LSE, stride_ob, stride_ot, stride_oh,
                  H, T, GROUP, scale_log2, C: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    NW: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    pair_m, b, h, kvh = _query_pair(H, GROUP, BLOCK_M)
    start = pair_m + C * BLOCK_M
    n = gl.cdiv(gl.minimum(start + BLOCK_M, T), BLOCK_N)      # key blocks up to this tile's diagonal
    n_full = gl.minimum(start // BLOCK_N, n)                 # key blocks wholly at or before the tile's first row
    q_pos = start + gl.arange(0, BLOCK_M, s_rows)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_tile = q_smem.index(C)
    mbarrier.wait(q_bar.index(C), 0)
    for j in range(0, n_full):
        acc, m_i, l_i = _fwd_step(j, q_tile, k_smem, v_smem, k_bar, v_bar, free_bar, acc, m_i, l_i, q_pos, zero_s, scale_log2,
                                  s_cols, p_layout, o_rows, BLOCK_N, STAGES, False)
    for j in range(n_full, n):
        acc, m_i, l_i = _fwd_step(j, q_tile, k_smem, v_smem, k_bar, v_bar, free_bar, acc, m_i, l_i, q_pos, zero_s, scale_log2,
                                  s_cols, p_layout, o_rows, BLOCK_N, STAGES, True)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    rows = start + gl.arange(0, BLOCK_M, o_rows)
    cols = gl.arange(0, HEAD_DIM, o_cols)
    o_ptrs = O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + gl.expand_dims(rows, 1) * stride_ot + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
    gl.store(LSE + (b * H + h).to(gl.int64) * T + q_pos, (m_i + gl.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

@gluon.jit
def _fwd_consumer_pp(q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, k_free, turn_bar, O, LSE, stride_ob, stride_ot, stride_oh,
                     H, T, GROUP, scale_log2, C: gl.constexpr,
                     HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     EARLY_K: gl.constexpr):
    """Ping-pong: the two consumers take turns to issue their wgmma (S_j = Q K_jᵀ together with O += P_{j-1} V_{j-1}),
    so one's softmax runs while the other's matmuls do. Each consumer takes n_max turns, the other consumer's count
    (with BLOCK_N = 2 BLOCK_M both have the same key blocks; otherwise the first may have one fewer, which it spends
    waiting and passing the turn). EARLY_K: a K slot is freed (k_free) as soon as its scores are done, V's (free_bar)
    after its product; else both after the product."""
    NW: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    o_cols: gl.constexpr = gl.SliceLayout(0, o_layout)
    pair_m, b, h, kvh = _query_pair(H, GROUP, BLOCK_M)
    start = pair_m + C * BLOCK_M
    n = gl.cdiv(gl.minimum(start + BLOCK_M, T), BLOCK_N)
    n_max = gl.cdiv(gl.minimum(pair_m + 2 * BLOCK_M, T), BLOCK_N)
    n_full = gl.minimum(start // BLOCK_N, n)
    q_pos = start + gl.arange(0, BLOCK_M, s_rows)
    m_i = gl.full([BLOCK_M], -1.0e30, gl.float32, s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    q_tile = q_smem.index(C)
    other = turn_bar.index(1 - C)
    mbarrier.wait(q_bar.index(C), 0)
    # block 0: scores only
    _take_turn(turn_bar, 0, C)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(other, count=1)
    s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
    if EARLY_K:
        mbarrier.arrive(k_free.index(0), count=1)
    if n_full == 0:
        k_pos = gl.arange(0, BLOCK_N, s_cols)
        s = gl.where(gl.expand_dims(q_pos, 1) >= gl.expand_dims(k_pos, 0), s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
    p = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    for j in range(1, n):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        _take_turn(turn_bar, j, C)
        mbarrier.wait(k_bar.index(slot), (j // STAGES) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(other, count=1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s])              # S_j done; P V_{j-1} may run on
        if EARLY_K:
            mbarrier.arrive(k_free.index(slot), count=1)
        if j >= n_full:
            k_pos = j * BLOCK_N + gl.arange(0, BLOCK_N, s_cols)
            s = gl.where(gl.expand_dims(q_pos, 1) >= gl.expand_dims(k_pos, 0), s, float("-inf"))
        p_new, alpha, m_i, l_i = _online_softmax(s, m_i, l_i, scale_log2)
        p = gl.convert_layout(p_new.to(gl.bfloat16), p_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(free_bar.index(prev), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_rows), 1)
    for j in range(n, n_max):                                         # turns this consumer has no block for
        _take_turn(turn_bar, j, C)
        mbarrier.arrive(other, count=1)
    last = (n - 1) % STAGES
    mbarrier.wait(v_bar.index(last), ((n - 1) // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    mbarrier.arrive(free_bar.index(last), count=1)
    acc = acc / gl.expand_dims(gl.convert_layout(l_i, o_rows), 1)
    rows = start + gl.arange(0, BLOCK_M, o_rows)
    cols = gl.arange(0, HEAD_DIM, o_cols)
    o_ptrs = O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh + gl.expand_dims(rows, 1) * stride_ot + gl.expand_dims(cols, 0)
    gl.store(o_ptrs, acc.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
    gl.store(LSE + (b * H + h).to(gl.int64) * T + q_pos, (m_i + gl.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

@gluon.jit
def ws_forward_pp_kernel(q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_ot, stride_oh, H, T, GROUP, scale_log2,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                         REGS: gl.constexpr, EARLY_K: gl.constexpr, num_warps: gl.constexpr):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = _ring_barriers(2, 1)
    k_bar = _ring_barriers(STAGES, 1)
    v_bar = _ring_barriers(STAGES, 1)
    free_bar = _ring_barriers(STAGES, 2)
    k_free = _ring_barriers(STAGES, 2)
    turn_bar = _ring_barriers(2, 1)
    gl.warp_specialize([
        (_fwd_consumer_pp, (q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, k_free, turn_bar, O, LSE, stride_ob, stride_ot,
                            stride_oh, H, T, GROUP, scale_log2, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, EARLY_K)),
        (_fwd_consumer_pp, (q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, k_free, turn_bar, O, LSE, stride_ob, stride_ot,
                            stride_oh, H, T, GROUP, scale_log2, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, EARLY_K)),
        (_fwd_loader_kv, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, k_free if EARLY_K else free_bar,
                          free_bar, H, T, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [REGS, LOADER_REGS])

@gluon.jit
def ws_forward_kernel(q_desc, k_desc, v_desc, O, LSE, stride_ob, stride_ot, stride_oh, H, T, GROUP, scale_log2,
                      HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      REGS: gl.constexpr, num_warps: gl.constexpr):
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = _ring_barriers(2, 1)
    k_bar = _ring_barriers(STAGES, 1)
    v_bar = _ring_barriers(STAGES, 1)
    free_bar = _ring_barriers(STAGES, 2)                  # both consumers release a slot
    gl.warp_specialize([
        (_fwd_consumer, (q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, O, LSE, stride_ob, stride_ot, stride_oh, H, T,
                         GROUP, scale_log2, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
        (_fwd_consumer, (q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, O, LSE, stride_ob, stride_ot, stride_oh, H, T,
                         GROUP, scale_log2, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
        (_fwd_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, free_bar, H, T, GROUP,
                       HEAD_DIM, BLOCK_M, BLOCK_N, STAGES)),
    ], [4, 1], [REGS, LOADER_REGS])

def ws_forward(q, k, v, variant=0):
    "Causal forward, bf16: (o, lse) like rtrainer's flash_attention_forward; `variant` indexes FORWARD_CONFIGS[head dim]."
    B, T, H, hd = q.shape
    block_m, block_n, stages, regs, schedule = FORWARD_CONFIGS[hd][variant]
    o = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    if schedule == "persistent-kt":                # the package's kernel
        n_pairs = triton.cdiv(T, 2 * block_m)
        hopper_forward_kernel[(min(n_pairs * B * H, torch.cuda.get_device_properties(q.device).multi_processor_count),)](
            _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(o, block_m), o, lse, *o.stride()[:3],
            H, T, H // k.shape[2], B * H, n_pairs, LOG2E / hd ** 0.5, HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
            REGS=regs, num_warps=CONSUMER_WARPS)
        return o, lse
    kernel, extra = (ws_forward_pp_kernel, dict(EARLY_K=schedule == "ppk")) if schedule in ("pp", "ppk") else (ws_forward_kernel, {})
    kernel[(triton.cdiv(T, 2 * block_m), B * H)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), o, lse, *o.stride()[:3], H, T, H // k.shape[2],
        LOG2E / hd ** 0.5, HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, REGS=regs, num_warps=CONSUMER_WARPS, **extra)
    return o, lse


# ---- dK/dV -----------------------------------------------------------------------------------------------------------

@gluon.jit
def _load_kv_pair(k_desc, v_desc, k_smem, v_smem, kv_bar, row, col, BLOCK_N: gl.constexpr):
    "Both consumers' K and V tiles (keys row .. row + 2 BLOCK_N), each pair on its consumer's barrier."
    for c in gl.static_range(2):
        mbarrier.expect(kv_bar.index(c), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row + c * BLOCK_N, col], kv_bar.index(c), k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [row + c * BLOCK_N, col], kv_bar.index(c), v_smem.index(c))

@gluon.jit
def _dkdv_loader(q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, free_bar,
                 KV, T, GROUP, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    start_n = gl.program_id(0) * 2 * BLOCK_N
    b = gl.program_id(1) // KV
    kvh = gl.program_id(1) % KV
    row0 = b * T
    _load_kv_pair(k_desc, v_desc, k_smem, v_smem, kv_bar, row0 + start_n, kvh * HEAD_DIM, BLOCK_N)
    first_i = start_n // BLOCK_M
    n_i = gl.cdiv(T, BLOCK_M) - first_i
    for u in range(GROUP * n_i):
        slot = u % STAGES
        mbarrier.wait(free_bar.index(slot), ((u // STAGES) & 1) ^ 1)
        row, col = row0 + (first_i + u % n_i) * BLOCK_M, (kvh * GROUP + u // n_i) * HEAD_DIM
        _load(q_desc, q_smem, q_bar, slot, row, col)
        _load(do_desc, do_smem, do_bar, slot, row, col)

@gluon.jit
def _dkdv_step(u, it, first_i, n_i, start_n, k_pos, k_tile, v_tile, q_smem, do_smem, q_bar, do_bar, free_bar, turn_bar, dk, dv, zero_s,
               LSE, DELTA, b, kvh, H, T, GROUP, scale_log2, C: gl.constexpr, query_cols: gl.constexpr, p_layout: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """Step u of a dK/dV consumer (ring position it + u): the query block's products with this consumer's keys, or
    nothing where every query precedes them; frees the slot. PINGPONG: take turns to issue the two score products."""
    slot = (it + u) % STAGES
    phase = ((it + u) // STAGES) & 1
    qi = first_i + u % n_i
    mbarrier.wait(q_bar.index(slot), phase)
    if PINGPONG:
        _take_turn(turn_bar, u, C)
    if (qi + 1) * BLOCK_M > start_n:
        sT = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(slot), phase)
        dpT = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - C), count=1)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=[sT])
        q_pos = qi * BLOCK_M + gl.arange(0, BLOCK_M, query_cols)
        head = (b * H + kvh * GROUP + u // n_i).to(gl.int64) * T
        lse2 = gl.load(LSE + head + q_pos, mask=q_pos < T, other=float("inf")) * 1.4426950408889634
        delta = gl.load(DELTA + head + q_pos, mask=q_pos < T, other=0.0)
        pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse2, 0))
        if qi * BLOCK_M < start_n + BLOCK_N:         # the block reaches the diagonal
            pT = gl.where(gl.expand_dims(q_pos, 0) >= gl.expand_dims(k_pos, 1), pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(gl.bfloat16), p_layout), do_smem.index(slot), dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=[dpT])
        dsT = pT * (dpT - gl.expand_dims(delta, 0))
        dk = warpgroup_mma(gl.convert_layout(dsT.to(gl.bfloat16), p_layout), q_smem.index(slot), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
    else:
        mbarrier.wait(do_bar.index(slot), phase)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - C), count=1)
    mbarrier.arrive(free_bar.index(slot), count=1)
    return dk, dv

@gluon.jit
def _dkdv_step_prefetch(u, it, first_i, n_i, start_n, k_pos, k_tile, v_tile, q_smem, do_smem, q_bar, do_bar, free_bar, dk, dv,
                        lse2, delta, zero_s, LSE, DELTA, b, kvh, H, T, GROUP, scale_log2, query_cols: gl.constexpr,
                        p_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                        AHEAD: gl.constexpr, COMPACT: gl.constexpr):
    """_dkdv_step with lse and δ loaded while the step's two score products run, so that their global-memory latency
    is off the critical path. AHEAD: this step's are already in registers and the next step's are loaded (more live
    registers); else this step's are loaded once its products are issued. COMPACT: query_cols is a layout of one value
    per thread (few live registers), converted to the score columns' layout where used."""
    slot = (it + u) % STAGES
    phase = ((it + u) // STAGES) & 1
    qi = first_i + u % n_i
    mbarrier.wait(q_bar.index(slot), phase)
    if (qi + 1) * BLOCK_M > start_n:
        sT = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(slot), phase)
        dpT = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if AHEAD:
            next_lse2, next_delta = _dkdv_rows(LSE, DELTA, u + 1, first_i, n_i, b, kvh, H, T, GROUP, query_cols, BLOCK_M)
        else:
            lse2, delta = _dkdv_rows(LSE, DELTA, u, first_i, n_i, b, kvh, H, T, GROUP, query_cols, BLOCK_M)
            next_lse2, next_delta = lse2, delta
        sT = warpgroup_mma_wait(num_outstanding=1, deps=[sT])
        lse_cols = gl.convert_layout(lse2, gl.SliceLayout(0, zero_s.type.layout))     # no-op unless COMPACT
        delta_cols = gl.convert_layout(delta, gl.SliceLayout(0, zero_s.type.layout))
        pT = gl.exp2(sT * scale_log2 - gl.expand_dims(lse_cols, 0))
        if qi * BLOCK_M < start_n + BLOCK_N:         # the block reaches the diagonal
            q_pos = qi * BLOCK_M + gl.arange(0, BLOCK_M, gl.SliceLayout(0, zero_s.type.layout))
            pT = gl.where(gl.expand_dims(q_pos, 0) >= gl.expand_dims(k_pos, 1), pT, 0.0)
        dv = warpgroup_mma(gl.convert_layout(pT.to(gl.bfloat16), p_layout), do_smem.index(slot), dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=[dpT])
        dsT = pT * (dpT - gl.expand_dims(delta_cols, 0))
        dk = warpgroup_mma(gl.convert_layout(dsT.to(gl.bfloat16), p_layout), q_smem.index(slot), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk])
    else:
        mbarrier.wait(do_bar.index(slot), phase)
        if AHEAD:
            next_lse2, next_delta = _dkdv_rows(LSE, DELTA, u + 1, first_i, n_i, b, kvh, H, T, GROUP, query_cols, BLOCK_M)
        else:
            next_lse2, next_delta = lse2, delta
    mbarrier.arrive(free_bar.index(slot), count=1)
    return dk, dv, next_lse2, next_delta

@gluon.jit
def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV,
                   stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, scale_log2, sm_scale, C: gl.constexpr,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   PINGPONG: gl.constexpr):
    "PINGPONG: the consumers take turns to issue their two score products (Sᵀ and dPᵀ); both take one turn per step."
    NW: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    pair_n = gl.program_id(0) * 2 * BLOCK_N
    start_n = pair_n + C * BLOCK_N
    b = gl.program_id(1) // KV
    kvh = gl.program_id(1) % KV
    first_i = pair_n // BLOCK_M                      # the loader's first query block (the pair's)
    n_i = gl.cdiv(T, BLOCK_M) - first_i
    k_pos = start_n + gl.arange(0, BLOCK_N, key_rows)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
    k_tile = k_smem.index(C)
    v_tile = v_smem.index(C)
    mbarrier.wait(kv_bar.index(C), 0)
    for u in range(GROUP * n_i):
        dk, dv = _dkdv_step(u, 0, first_i, n_i, start_n, k_pos, k_tile, v_tile, q_smem, do_smem, q_bar, do_bar,
                            free_bar, turn_bar, dk, dv, zero_s, LSE, DELTA, b, kvh, H, T, GROUP, scale_log2, C, query_cols, p_layout,
                            BLOCK_N, BLOCK_M, STAGES, PINGPONG)
    rows = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, a_layout))
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, a_layout))
    out = b.to(gl.int64) * stride_dkb + kvh.to(gl.int64) * stride_dkh + gl.expand_dims(rows, 1) * stride_dkt + gl.expand_dims(cols, 0)
    gl.store(DK + out, (dk * sm_scale).to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
    gl.store(DV + out, dv.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)

@gluon.jit
def ws_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh,
                   H, KV, T, GROUP, scale_log2, sm_scale,
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   REGS: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    kv_bar = _ring_barriers(2, 1)
    q_bar = _ring_barriers(STAGES, 1)
    do_bar = _ring_barriers(STAGES, 1)
    free_bar = _ring_barriers(STAGES, 2)
    turn_bar = _ring_barriers(2, 1)
    gl.warp_specialize([
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV,
                          stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, scale_log2, sm_scale, 0,
                          HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, PINGPONG)),
        (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, free_bar, turn_bar, LSE, DELTA, DK, DV,
                          stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, scale_log2, sm_scale, 1,
                          HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, PINGPONG)),
        (_dkdv_loader, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, q_bar, do_bar, free_bar,
                        KV, T, GROUP, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
    ], [4, 1], [REGS, LOADER_REGS])

# Persistent dK/dV: one program per SM over the (key pair, batch x KV head) tiles, most query blocks first; the loader
# fetches the next tile's K and V once both consumers are done with the current ones, and dK, dV leave through
# shared memory by TMA stores that overlap the next tile.

@gluon.jit
def _dkdvp_consumer(k_smem, v_smem, q_smem, do_smem, out_smem, dk_desc, dv_desc, kv_bar, kv_free, q_bar, do_bar, free_bar,
                    LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, BKV, n_pairs, scale_log2, sm_scale,
                    C: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                    PREFETCH: gl.constexpr, AHEAD: gl.constexpr, COMPACT: gl.constexpr):
    NW: gl.constexpr = 4
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_layout, k_width=2)
    key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    zero_s = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    k_tile = k_smem.index(C)
    v_tile = v_smem.index(C)
    it = 0
    tc = 0
    for t in range(gl.program_id(0), n_pairs * BKV, gl.num_programs(0)):
        pair_n = (t // BKV) * 2 * BLOCK_N
        start_n = pair_n + C * BLOCK_N
        b = (t % BKV) // KV
        kvh = (t % BKV) % KV
        first_i = pair_n // BLOCK_M
        n_i = gl.cdiv(T, BLOCK_M) - first_i
        steps = GROUP * n_i
        k_pos = start_n + gl.arange(0, BLOCK_N, key_rows)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, a_layout)
        mbarrier.wait(kv_bar.index(C), tc & 1)
        if PREFETCH:
            row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0]) if COMPACT else query_cols
            lse2, delta = _dkdv_rows(LSE, DELTA, 0, first_i, n_i, b, kvh, H, T, GROUP, row_layout, BLOCK_M)
            for u in range(steps):
                dk, dv, lse2, delta = _dkdv_step_prefetch(u, it, first_i, n_i, start_n, k_pos, k_tile, v_tile, q_smem, do_smem,
                                                          q_bar, do_bar, free_bar, dk, dv, lse2, delta, zero_s, LSE, DELTA, b, kvh,
                                                          H, T, GROUP, scale_log2, row_layout, p_layout, BLOCK_N, BLOCK_M, STAGES,
                                                          AHEAD, COMPACT)
        else:
            for u in range(steps):
                dk, dv = _dkdv_step(u, it, first_i, n_i, start_n, k_pos, k_tile, v_tile, q_smem, do_smem, q_bar, do_bar, free_bar,
                                    kv_bar, dk, dv, zero_s, LSE, DELTA, b, kvh, H, T, GROUP, scale_log2, C, query_cols, p_layout,
                                    BLOCK_N, BLOCK_M, STAGES, False)
        mbarrier.arrive(kv_free.index(C), count=1)            # K and V of this tile are no longer read
        if start_n + BLOCK_N <= T:
            tma.store_wait(0)
            out_smem.index(0).store((dk * sm_scale).to(gl.bfloat16))
            out_smem.index(1).store(dv.to(gl.bfloat16))
            fence_async_shared()
            tma.async_copy_shared_to_global(dk_desc, [b * T + start_n, kvh * HEAD_DIM], out_smem.index(0))
            tma.async_copy_shared_to_global(dv_desc, [b * T + start_n, kvh * HEAD_DIM], out_smem.index(1))
        else:
            rows = start_n + gl.arange(0, BLOCK_N, gl.SliceLayout(1, a_layout))
            cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, a_layout))
            out = b.to(gl.int64) * stride_dkb + kvh.to(gl.int64) * stride_dkh + gl.expand_dims(rows, 1) * stride_dkt + gl.expand_dims(cols, 0)
            gl.store(DK + out, (dk * sm_scale).to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
            gl.store(DV + out, dv.to(gl.bfloat16), mask=gl.expand_dims(rows, 1) < T)
        it += steps
        tc += 1
    tma.store_wait(0)

@gluon.jit
def ws_dkdv_persistent_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh,
                              H, KV, T, GROUP, BKV, n_pairs, scale_log2, sm_scale,
                              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                              REGS: gl.constexpr, PREFETCH: gl.constexpr, AHEAD: gl.constexpr, COMPACT: gl.constexpr,
                              num_warps: gl.constexpr):
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    out0 = gl.allocate_shared_memory(dk_desc.dtype, [2, BLOCK_N, HEAD_DIM], dk_desc.layout)
    out1 = gl.allocate_shared_memory(dk_desc.dtype, [2, BLOCK_N, HEAD_DIM], dk_desc.layout)
    kv_bar = _ring_barriers(2, 1)
    kv_free = _ring_barriers(2, 1)
    q_bar = _ring_barriers(STAGES, 1)
    do_bar = _ring_barriers(STAGES, 1)
    free_bar = _ring_barriers(STAGES, 2)
    gl.warp_specialize([
        (_dkdvp_consumer, (k_smem, v_smem, q_smem, do_smem, out0, dk_desc, dv_desc, kv_bar, kv_free, q_bar, do_bar, free_bar,
                           LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, BKV, n_pairs, scale_log2, sm_scale,
                           0, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, PREFETCH, AHEAD, COMPACT)),
        (_dkdvp_consumer, (k_smem, v_smem, q_smem, do_smem, out1, dk_desc, dv_desc, kv_bar, kv_free, q_bar, do_bar, free_bar,
                           LSE, DELTA, DK, DV, stride_dkb, stride_dkt, stride_dkh, H, KV, T, GROUP, BKV, n_pairs, scale_log2, sm_scale,
                           1, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES, PREFETCH, AHEAD, COMPACT)),
        (_dkdv_persistent_loader, (q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_bar, kv_free, q_bar, do_bar, free_bar,
                         KV, T, GROUP, BKV, n_pairs, HEAD_DIM, BLOCK_N, BLOCK_M, STAGES)),
    ], [4, 1], [REGS, LOADER_REGS])

def ws_dkdv(do, q, k, v, lse, delta, variant=0):
    "dK, dV (B,T,KV,hd) of the causal attention, from the forward's lse and delta = rowsum(dO * O) (fp32, (B,H,T))."
    B, T, H, hd = q.shape
    KV = k.shape[2]
    block_n, block_m, stages, regs, schedule = DKDV_CONFIGS[hd][variant]
    dk = torch.empty(B, T, KV, hd, dtype=q.dtype, device=q.device)
    dv = torch.empty_like(dk)
    do = do.contiguous()
    if schedule.startswith("persistent-t"):
        n_pairs = triton.cdiv(T, 2 * block_n)
        ws_dkdv_persistent_kernel[(min(n_pairs * B * KV, torch.cuda.get_device_properties(q.device).multi_processor_count),)](
            _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
            _descriptor(dk, block_n), _descriptor(dv, block_n), lse, delta, dk, dv, *dk.stride()[:3], H, KV, T, H // KV, B * KV, n_pairs,
            LOG2E / hd ** 0.5, 1.0 / hd ** 0.5, HEAD_DIM=hd, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, REGS=regs,
            PREFETCH=schedule != "persistent-t", AHEAD=schedule in ("persistent-tp", "persistent-tc"),
            COMPACT=schedule == "persistent-tc", num_warps=CONSUMER_WARPS)
        return dk, dv
    ws_dkdv_kernel[(triton.cdiv(T, 2 * block_n), B * KV)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
        lse, delta, dk, dv, *dk.stride()[:3], H, KV, T, H // KV, LOG2E / hd ** 0.5, 1.0 / hd ** 0.5,
        HEAD_DIM=hd, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=stages, REGS=regs, PINGPONG=schedule == "pp",
        num_warps=CONSUMER_WARPS)
    return dk, dv

# ---- dQ --------------------------------------------------------------------------------------------------------------

# dQ: the package's persistent kernel (hopper_dq_kernel); the ping-pong one per query pair ("pp", measured in rounds 1
# to 7) is at commit c8c90ab

def ws_dq(do, q, k, v, o, lse, variant=0):
    "(dq (B,T,H,hd), delta (B,H,T) fp32) of the causal attention, like rtrainer's flash_backward_dq."
    B, T, H, hd = q.shape
    block_m, block_n, stages, regs, schedule = DQ_CONFIGS[hd][variant]
    dq = torch.empty(B, T, H, hd, dtype=q.dtype, device=q.device)
    delta = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    do = do.contiguous()
    n_pairs = triton.cdiv(T, 2 * block_m)
    hopper_dq_kernel[(min(n_pairs * B * H, torch.cuda.get_device_properties(q.device).multi_processor_count),)](
        _descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n), _descriptor(do, block_m),
        _descriptor(o, block_m), _descriptor(dq, block_m), lse, delta, dq, *dq.stride()[:3], H, T, H // k.shape[2], B * H,
        n_pairs, LOG2E / hd ** 0.5, 1.0 / hd ** 0.5, HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages,
        REGS=regs, num_warps=CONSUMER_WARPS)
    return dq, delta


def _maxnreg(ptx):
    return re.findall(r"setmaxnreg[.a-z0-9]*\s+(\d+)", ptx)

KERNELS = dict(  # kind: (configs, kernel of a schedule, constexpr names of a config, descriptor blocks of a config)
    forward=(FORWARD_CONFIGS, dict(ws=ws_forward_kernel, pp=ws_forward_pp_kernel, ppk=ws_forward_pp_kernel, **{"persistent-kt": hopper_forward_kernel}), ("BLOCK_M", "BLOCK_N", "STAGES", "REGS"),
             lambda hd, bm, bn: dict(q_desc=(bm, hd), k_desc=(bn, hd), v_desc=(bn, hd), o_desc=(bm, hd))),
    dkdv=(DKDV_CONFIGS, dict(ws=ws_dkdv_kernel, pp=ws_dkdv_kernel, **{s: ws_dkdv_persistent_kernel for s in ("persistent-t", "persistent-tp", "persistent-te", "persistent-tc")}),
          ("BLOCK_N", "BLOCK_M", "STAGES", "REGS"),
          lambda hd, bn, bm: dict(q_desc=(bm, hd), do_desc=(bm, hd), k_desc=(bn, hd), v_desc=(bn, hd), dk_desc=(bn, hd), dv_desc=(bn, hd))),
    dq=(DQ_CONFIGS, {"persistent-t": hopper_dq_kernel}, ("BLOCK_M", "BLOCK_N", "STAGES", "REGS"),
        lambda hd, bm, bn: dict(q_desc=(bm, hd), do_desc=(bm, hd), k_desc=(bn, hd), v_desc=(bn, hd), o_desc=(bm, hd), dq_desc=(bm, hd))))

def compile_check():
    "Compile every variant for sm_90 without a GPU; print registers, spills, shared memory and the partitions' register counts."
    for kind, (configs, kernels, names, descs) in KERNELS.items():
        for hd, config in ((hd, c) for hd, cs in configs.items() for c in cs):
            try:
                extra = (dict(PINGPONG=config[-1] == "pp") if kind == "dkdv" and config[-1] in ("ws", "pp") else
                         dict(PREFETCH=config[-1] != "persistent-t", AHEAD=config[-1] in ("persistent-tp", "persistent-tc"),
                              COMPACT=config[-1] == "persistent-tc") if kind == "dkdv" else
                         dict(EARLY_K=config[-1] == "ppk") if kind == "forward" and config[-1] in ("pp", "ppk") else
                         {})
                usage, smem, ptx = _compile_sm90(kernels[config[-1]], dict(HEAD_DIM=hd, num_warps=CONSUMER_WARPS, **extra, **dict(zip(names, config[:-1]))),
                                                 descs(hd, config[0], config[1]), CONSUMER_WARPS)
                print(f"{kind} hd {hd} {config}: {usage}, shared {smem} B, setmaxnreg {_maxnreg(ptx)}, wgmma {ptx.count('wgmma.mma_async')}")
            except Exception as e:
                print(f"{kind} hd {hd} {config}: FAILED {type(e).__name__}: {str(e)[-1200:]}")

LAUNCH = dict(forward=lambda a, i: ws_forward(a["q"], a["k"], a["v"], i),
              dq=lambda a, i: ws_dq(a["do"], a["q"], a["k"], a["v"], a["o"], a["lse"], i),
              dkdv=lambda a, i: ws_dkdv(a["do"], a["q"], a["k"], a["v"], a["lse"], a["delta"], i))
CHECK_CASES = ((2, 1000, 12, 4, 64), (1, 777, 16, 16, 128), (2, 257, 8, 1, 128), (1, 1, 4, 2, 64), (1, 4099, 4, 2, 64),
               (1, 300, 6, 2, 128))
SMOKE_TIMEOUT_S = 75

def _inputs(B, T, H, KV, hd, seed=1):
    "bf16 q, k, v (fused views), dO, rtrainer's forward o and lse, and δ."
    from rtrainer.attention import fused_qkv_views, flash_attention_forward
    torch.manual_seed(seed)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, torch.bfloat16, "cuda")
    do = torch.randn(B, T, H, hd, dtype=torch.bfloat16, device="cuda")
    o, lse = flash_attention_forward(q, k, v, True)
    delta = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, delta=delta)

def smoke(kind):
    "One small launch of every variant of one kernel, printing each that finished (run in a child with a time limit)."
    configs = KERNELS[kind][0]
    for hd in configs:
        a = _inputs(1, 400, 4, 2, hd)
        for variant in range(len(configs[hd])):
            print(f"SMOKE {hd} {variant} started", flush=True)
            LAUNCH[kind](a, variant)
            torch.cuda.synchronize()
            print(f"SMOKE {hd} {variant} ok", flush=True)

def _smoked(payload, kind):
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--smoke", kind], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
        out, note = r.stdout, "" if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-400:]}"
    except subprocess.TimeoutExpired as e:
        out, note = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")), f"hung: stopped after {SMOKE_TIMEOUT_S} s"
    done = {(int(hd), int(v)) for hd, v in re.findall(r"SMOKE (\d+) (\d+) ok", out)}
    payload["smoke"].append(dict(kernel=kind, finished=sorted(done), note=note))
    print(f"smoke {kind}: finished {sorted(done)} {note}", flush=True)
    return done

def check(kind, case, variant):
    "Relative errors of one variant against float64 autograd (and δ against rowsum(dO ∘ O))."
    from rtrainer.attention import relative_error, attention_reference
    B, T, H, KV, hd = case
    a = _inputs(*case)
    q64, k64, v64 = (a[n].detach().double().requires_grad_() for n in "qkv")
    out64 = attention_reference(q64, k64, v64, True)
    if kind == "forward":
        o, lse = LAUNCH[kind](a, variant)
        ref_o, ref_lse = reference(a["q"], a["k"], a["v"])
        return dict(o=relative_error(o, ref_o), lse=relative_error(lse, ref_lse))
    dq64, dk64, dv64 = torch.autograd.grad(out64, (q64, k64, v64), a["do"].double())
    if kind == "dq":
        dq, delta = LAUNCH[kind](a, variant)
        return dict(dq=relative_error(dq, dq64), delta=relative_error(delta, (a["o"].double() * a["do"].double()).sum(-1).transpose(1, 2)))
    dk, dv = LAUNCH[kind](a, variant)
    return dict(dk=relative_error(dk, dk64), dv=relative_error(dv, dv64))

def _checked(payload, kind):
    configs = KERNELS[kind][0]
    alive = _smoked(payload, kind)
    passed = set()
    for hd in configs:
        for variant, config in enumerate(configs[hd]):
            ok = (hd, variant) in alive
            for case in (c for c in CHECK_CASES if c[-1] == hd):
                if not ok: break
                try: row = check(kind, case, variant)
                except Exception as e: row = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                row.update(kernel=kind, case=case, variant=config,
                           ok="error" not in row and all(math.isfinite(x) and x < 1e-2 for x in row.values() if isinstance(x, float)))
                payload["checks"].append(row)
                print(row, flush=True)
                ok = row["ok"]
            if ok: passed.add((hd, variant))
    return passed

def gpu_main():
    from rtrainer.attention import (flash_attention_forward, flash_backward_dq, flash_backward_dkdv, attention_flops,
                                    REFERENCE_ATTENTION_SHAPES)
    from torch.nn.attention import sdpa_kernel, SDPBackend
    import torch.nn.functional as F
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   configs={k: {str(hd): c for hd, c in v[0].items()} for k, v in KERNELS.items()}, rounds=ROUNDS,
                   smoke=[], checks=[], rows=[])
    passed = {kind: _checked(payload, kind) for kind in KERNELS}
    shapes = [s for s in os.environ.get("WS_SHAPES", "dense1b,rb100m,moe4b,prof183m").split(",") if s]
    table = []
    for name in shapes:
        B, H, KV, T, hd = REFERENCE_ATTENTION_SHAPES[name]
        a = _inputs(B, T, H, KV, hd, seed=2)
        q, k, v, do, o, lse, delta = (a[n] for n in ("q", "k", "v", "do", "o", "lse", "delta"))
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k.repeat_interleave(H // KV, 2), v.repeat_interleave(H // KV, 2)))
        dot = do.transpose(1, 2)
        def cudnn_fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION): return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
        def cudnn_both():
            torch.autograd.grad(cudnn_fwd(), (qt, kt, vt), dot)
        flops = attention_flops(B, H, T, hd)
        best = {}
        for kind, base, work in (("forward", lambda: flash_attention_forward(q, k, v, True), flops),
                                 ("dq", lambda: flash_backward_dq(do, q, k, v, o, lse, True), 1.5 * flops),
                                 ("dkdv", lambda: flash_backward_dkdv(do, q, k, v, lse, delta, True), 2 * flops)):
            arms = {"rtrainer": base}
            if kind == "forward": arms["cudnn"] = cudnn_fwd
            configs = KERNELS[kind][0][hd]
            for i, c in enumerate(configs):
                if (hd, i) in passed[kind]: arms["ws " + "/".join(map(str, c))] = (lambda i=i: LAUNCH[kind](a, i))
            times = _alternate(arms, ROUNDS)
            med = {arm: statistics.median(t) for arm, t in times.items()}
            row = dict(shape=name, kernel=kind, ms=med, tflops={arm: work / m / 1e9 for arm, m in med.items()})
            ws_arms = [arm for arm in arms if arm.startswith("ws")]
            row["speed vs rtrainer"] = {arm: _ratios(times, "rtrainer", arm) for arm in ws_arms}
            if ws_arms and min(med[a] for a in ws_arms) < med["rtrainer"]:     # else forward + backward keeps rtrainer's kernel
                top = min(ws_arms, key=med.get)
                best[kind] = (configs[[("ws " + "/".join(map(str, c))) for c in configs].index(top)], top)
            payload["rows"].append(row)
            print(name, kind, {arm: round(x, 1) for arm, x in row["tflops"].items()}, flush=True)
            table.append((name, kind, row["tflops"]))
        # forward + backward: rtrainer's three kernels; the fastest of each kind (a Gluon variant where one beat rtrainer's); cuDNN
        def ws_all():
            for kind in ("forward", "dq", "dkdv"):
                if kind in best: LAUNCH[kind](a, KERNELS[kind][0][hd].index(best[kind][0]))
                else: dict(forward=lambda: flash_attention_forward(q, k, v, True), dq=lambda: flash_backward_dq(do, q, k, v, o, lse, True),
                           dkdv=lambda: flash_backward_dkdv(do, q, k, v, lse, delta, True))[kind]()
        def rt_all():
            flash_attention_forward(q, k, v, True); flash_backward_dq(do, q, k, v, o, lse, True); flash_backward_dkdv(do, q, k, v, lse, delta, True)
        times = _alternate(dict(rtrainer=rt_all, ws=ws_all, cudnn=cudnn_both), ROUNDS)
        med = {arm: statistics.median(t) for arm, t in times.items()}
        row = dict(shape=name, kernel="forward+backward", best={k: v[1] for k, v in best.items()}, ms=med,
                   tflops={arm: 3.5 * flops / m / 1e9 for arm, m in med.items()},
                   ws_vs_cudnn=_ratios(times, "cudnn", "ws"), rtrainer_vs_cudnn=_ratios(times, "cudnn", "rtrainer"),
                   ws_vs_rtrainer=_ratios(times, "rtrainer", "ws"))
        payload["rows"].append(row)
        table.append((name, "fwd+bwd", row["tflops"]))
        print(name, "fwd+bwd", {arm: round(x, 1) for arm, x in row["tflops"].items()},
              "ws/cudnn %.3f [%.3f, %.3f]" % row["ws_vs_cudnn"], "rtrainer/cudnn %.3f [%.3f, %.3f]" % row["rtrainer_vs_cudnn"], flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_ws.json"), "w") as f: json.dump(payload, f, indent=1)
    print("\nshape     kernel            TFLOP/s by arm")
    for name, kind, tf in table:
        print(f"{name:9} {kind:16} " + ", ".join(f"{arm} {x:.1f}" for arm, x in tf.items()))

if __name__ == "__main__":
    if "--compile" in sys.argv: compile_check()
    elif "--smoke" in sys.argv: smoke(sys.argv[sys.argv.index("--smoke") + 1])
    elif not torch.cuda.is_available(): sys.exit("attention_ws: needs a CUDA GPU (or --compile)")
    else: gpu_main()
