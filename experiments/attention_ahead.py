"""A flash-attention forward that computes the next key block's scores before this block's softmax.

rtrainer's forward (`flash_forward_kernel`) runs, per key block, `S = Q Kᵀ`, the softmax on `S`, then `P V`: the
softmax waits for `S`, and the next `Q Kᵀ` waits for the softmax, so within one program the tensor cores and the
exponential units take turns. The kernel here issues `S_next = Q K_nextᵀ` first and then does the current block's
softmax, so that an asynchronous `Q Kᵀ` can run while the softmax does (the intra-warpgroup overlap of
FlashAttention-3). It holds one more (BLOCK_M, BLOCK_N) fp32 tile in registers. The last full block's lookahead is the
diagonal (masked) block's scores, so the masked step overlaps too.

Whether the overlap happens is the compiler's call, and with Triton 3.6 it does not: compiled for sm_90 (`--inspect`,
no GPU needed), the early `Q Kᵀ` is issued asynchronously and then waited for at once (`warp_group_dot_wait` with
0 pending, which also waits for the previous `P V`), before the softmax, exactly as in rtrainer's kernel. The
lookahead only costs registers and shared memory (head dim 128, 64 x 64 tiles, 4 warps, 3 stages: 228 registers and
128 KB against 178 and 112 KB, so one program per SM instead of two). So it was not timed. Placing the waits by hand
needs Gluon (`triton.experimental.gluon`: `warpgroup_mma(is_async=True)`, `warpgroup_mma_wait`, `warp_specialize`).

`--inspect` prints the wgmma ops, their waits and the register use of both kernels; `--cpu-check` checks the math in
the interpreter (`TRITON_INTERPRET=1`) against float64; on a GPU the script checks, then times both kernels against
each other, alternated, at the reference shapes (writes $OUT/attention_ahead.json when OUT is set)."""
import json, os, re, statistics, sys, time
import torch
import triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_variants import reference                              # float64 (o, lse)
import triton.language as tl
from rtrainer.attention import (flash_attention_forward, fused_qkv_views, tuned_config, _query_block,
                                REFERENCE_ATTENTION_SHAPES, LOG2_E, attention_flops)
from rtrainer.kernels import median_ms, relative_error, INTERPRETING, ratio_interval

ROUNDS = 5

@triton.jit
def _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.math.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i

@triton.jit
def ahead_forward_kernel(
    Q, K, V, O, LSE, stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, H, T, GROUP, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # causal only; BLOCK_M == BLOCK_N, so a query block has full key blocks [0, start_m) and one diagonal block
    start_m, b, h, kvh, q_pos, offs_d = _query_block(H, GROUP, BLOCK_M, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + b * stride_qb + h * stride_qh + q_pos[:, None] * stride_qt + offs_d[None, :], mask=q_pos[:, None] < T, other=0.0)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the first block's scores (the diagonal block when start_m == 0)
    k_pos = offs_n
    s = tl.dot(q, tl.load(k_base + k_pos[None, :] * stride_kt + offs_d[:, None], mask=k_pos[None, :] < T, other=0.0),
               input_precision=PRECISION)
    for start_n in range(0, start_m, BLOCK_N):                     # full blocks: the next block's scores go first
        v = tl.load(v_base + (start_n + offs_n)[:, None] * stride_vt + offs_d[None, :])
        k_next = start_n + BLOCK_N + offs_n                        # the last full block's next is the diagonal block
        s_next = tl.dot(q, tl.load(k_base + k_next[None, :] * stride_kt + offs_d[:, None], mask=k_next[None, :] < T, other=0.0),
                        input_precision=PRECISION)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION)
        s = s_next
    # the diagonal block: mask, then the same step
    k_pos = start_m + offs_n
    s = tl.where((k_pos[None, :] < T) & (q_pos[:, None] >= k_pos[None, :]), s, float("-inf"))
    v = tl.load(v_base + k_pos[:, None] * stride_vt + offs_d[None, :], mask=k_pos[:, None] < T, other=0.0)
    acc, m_i, l_i = _softmax_step(acc, m_i, l_i, s, v, scale_log2, PRECISION)
    acc = acc / l_i[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + q_pos[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty), mask=q_pos[:, None] < T)
    tl.store(LSE + (b * H + h) * T + q_pos, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=q_pos < T)

def ahead_forward(q, k, v, o=None, lse=None, config=None):
    "Causal forward with the scores computed one key block ahead; (o, lse) like flash_attention_forward."
    B, T, H, hd = q.shape
    KV = k.shape[2]
    o = torch.empty_like(q) if o is None else o
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device) if lse is None else lse
    if config is None:
        config = dict(BLOCK_M=16, BLOCK_N=16) if INTERPRETING else tuned_config("forward", hd, T)
        config = dict(config, BLOCK_N=config["BLOCK_M"])           # this kernel needs square tiles
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    ahead_forward_kernel[(triton.cdiv(T, config["BLOCK_M"]), B * H)](
        q, k, v, o, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, T, H // KV,
        LOG2_E / hd ** 0.5, HEAD_DIM=hd, PRECISION=precision, **config)
    return o, lse

def check(B, T, H, KV, hd, dtype, device):
    torch.manual_seed(0)
    q, k, v = fused_qkv_views(B, T, H, KV, hd, dtype, device)
    o, lse = ahead_forward(q, k, v, o=torch.full_like(q, float("nan")), lse=torch.full((B, H, T), float("nan"), device=device))
    ref_o, ref_lse = reference(q, k, v)
    return relative_error(o, ref_o), relative_error(lse, ref_lse)

def inspect():
    "Compile both forwards for sm_90 with Triton's own compiler (no GPU) and print the loop's wgmma waits and registers."
    import inspect as ins
    from sm90_compile import compile_sm90, ptxas_usage
    from rtrainer.attention import flash_forward_kernel
    for hd in (64, 128):
        for name, kernel in (("rtrainer", flash_forward_kernel), ("ahead", ahead_forward_kernel)):
            params = list(ins.signature(kernel.fn).parameters)
            consts = dict(HEAD_DIM=hd, BLOCK_M=64, BLOCK_N=64, PRECISION="tf32", **({"CAUSAL": True} if "CAUSAL" in params else {}))
            sig, hints = {}, []
            for p in params:
                if p in consts: continue
                elif p in ("Q", "K", "V", "O"): sig[p] = "*bf16"; hints.append(p)
                elif p == "LSE": sig[p] = "*fp32"; hints.append(p)
                elif p == "scale_log2": sig[p] = "fp32"
                else:
                    sig[p] = "i32"
                    if p.startswith("stride") or p == "T": hints.append(p)
            c = compile_sm90(kernel, sig, consts, hints, warps=4, stages=3)
            ttgir = c.asm["ttgir"]
            dots = re.findall(r"ttng.warp_group_dot [^\n]*", ttgir)
            waits = re.findall(r"ttng.warp_group_dot_wait [^\n]*pendings = (\d+)", ttgir)
            registers, spilled = ptxas_usage(c.asm["ptx"])
            print(f"hd {hd} {name:8}: {len(dots)} wgmma ops ({sum('isAsync = true' in d for d in dots)} async), waits with pendings {waits},"
                  f" {registers} registers, spills {spilled} bytes, smem {c.metadata.shared}")

def gpu_main():
    dev, bf16 = "cuda", torch.bfloat16
    payload = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, rounds=ROUNDS, checks=[], rows=[])
    for (B, T, H, KV, hd) in ((2, 1000, 12, 4, 64), (1, 777, 16, 16, 128), (1, 4099, 4, 2, 64)):
        o_err, lse_err = check(B, T, H, KV, hd, bf16, dev)
        payload["checks"].append(dict(B=B, T=T, H=H, KV=KV, hd=hd, o=o_err, lse=lse_err, ok=o_err < 1e-2 and lse_err < 1e-2))
        print(payload["checks"][-1], flush=True)
    if not all(c["ok"] for c in payload["checks"]):
        print("ahead_forward failed its checks: not timed")
    else:
        for name in ("rb100m", "dense1b", "moe4b"):
            B, H, KV, T, hd = REFERENCE_ATTENTION_SHAPES[name]
            q, k, v = fused_qkv_views(B, T, H, KV, hd, bf16, dev)
            o, lse = torch.empty_like(q), torch.empty(B, H, T, dtype=torch.float32, device=dev)
            arms = {"rtrainer": lambda: flash_attention_forward(q, k, v, True, o=o, lse=lse), "ahead": lambda: ahead_forward(q, k, v, o=o, lse=lse)}
            for fn in arms.values(): fn()
            times = {a: [] for a in arms}
            for r in range(ROUNDS):
                for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]): times[a].append(median_ms(arms[a]))
            ratios = [x / y for x, y in zip(times["rtrainer"], times["ahead"])]
            mean, low, high = ratio_interval(ratios)
            flops = attention_flops(B, H, T, hd)
            row = dict(shape=name, rtrainer_ms=statistics.median(times["rtrainer"]), ahead_ms=statistics.median(times["ahead"]),
                       rtrainer_tflops=flops / statistics.median(times["rtrainer"]) / 1e9, ahead_tflops=flops / statistics.median(times["ahead"]) / 1e9,
                       speedup=mean, ci95_low=low, ci95_high=high)
            payload["rows"].append(row)
            print(f"{name:9} forward TFLOP/s rtrainer {row['rtrainer_tflops']:6.1f}  ahead {row['ahead_tflops']:6.1f}  speedup {mean:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention_ahead.json"), "w") as f: json.dump(payload, f, indent=1)

if __name__ == "__main__":
    if "--inspect" in sys.argv: inspect()
    elif "--cpu-check" in sys.argv:
        for case in ((1, 37, 4, 2, 16), (2, 16, 2, 1, 32), (1, 1, 2, 2, 16), (1, 50, 2, 2, 64)):
            print(case, "o, lse relative errors: %.1e %.1e" % check(*case, torch.float32, "cpu"))
    elif not torch.cuda.is_available(): sys.exit("attention_ahead: needs a CUDA GPU (or --inspect, or --cpu-check under TRITON_INTERPRET=1)")
    else: gpu_main()
