"""Forward + backward of flash attention through the package, with the Hopper kernels on and off, against cuDNN, at
the four reference shapes and over T 512-8192 (rb100m's heads at 32,768 tokens, as the attention chapter's sweep, and
dense1b's heads at 16,384 tokens): three alternated rounds in one process, the median of CUDA-event-timed runs per arm, a
95% interval on the paired ratios. Writes data/results/attention_hopper.json; prints a table last."""
import statistics, torch
import rtrainer.attention_hopper as hopper
from rtrainer.attention import (flash_attention, attention_benchmark_inputs, attention_flops, REFERENCE_ATTENTION_SHAPES, _sdpa_attention,
                                SWEEP_LENGTHS, SWEEP_TOKENS, SWEEP_HEADS)
from rtrainer.kernels import median_ms, ratio_interval, save_results

ROUNDS = 3
SHAPES = dict(REFERENCE_ATTENTION_SHAPES)
SHAPES.update({f"sweep T{T}": (max(1, SWEEP_TOKENS // T), *SWEEP_HEADS[:2], T, SWEEP_HEADS[2]) for T in SWEEP_LENGTHS})
SHAPES.update({f"sweep128 T{T}": (max(1, 16384 // T), 16, 16, T, 128) for T in SWEEP_LENGTHS if T != 1024})
rows = []
for name, (B, H, KV, T, hd) in SHAPES.items():
    q, k, v, do, kr, vr = attention_benchmark_inputs(B, H, KV, T, hd)
    cudnn = _sdpa_attention("CUDNN_ATTENTION", False)
    def both(fn, kk, vv, enabled):
        def step():
            hopper.ENABLED = enabled
            torch.autograd.grad(fn(q, kk, vv), (q, kk, vv), do)
        return step
    arms = {"hopper": both(flash_attention, k, v, True), "triton": both(flash_attention, k, v, False), "cudnn": both(cudnn, kr, vr, False)}
    for step in arms.values(): step()
    times = {a: [] for a in arms}
    for r in range(ROUNDS):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]): times[a].append(median_ms(arms[a]))
    hopper.ENABLED = True
    flops = 3.5 * attention_flops(B, H, T, hd)
    med = {a: statistics.median(t) for a, t in times.items()}
    row = dict(shape=name, B=B, H=H, KV=KV, T=T, hd=hd, ms=med, tflops={a: flops / m / 1e9 for a, m in med.items()},
               hopper_vs_cudnn=ratio_interval([c / h for c, h in zip(times["cudnn"], times["hopper"])]),
               triton_vs_cudnn=ratio_interval([c / t for c, t in zip(times["cudnn"], times["triton"])]),
               hopper_vs_triton=ratio_interval([t / h for t, h in zip(times["triton"], times["hopper"])]))
    rows.append(row)
    print(name, {a: round(x, 1) for a, x in row["tflops"].items()}, "hopper/cudnn %.3f [%.3f, %.3f]" % row["hopper_vs_cudnn"], flush=True)
save_results("attention_hopper", rows, rounds=ROUNDS, method="forward + backward through flash_attention (autograd), Hopper kernels on/off, and cuDNN SDPA with K, V repeated to H heads; median of CUDA-event-timed runs per arm, arms alternated; ratios: 95% t-interval over the paired rounds", flop_convention="causal = half of 4*B*H*T^2*hd; forward + backward = 3.5x the forward")
print("\nshape          hopper  triton  cudnn   (TFLOP/s, fwd+bwd)   hopper/cudnn            triton/cudnn            hopper/triton")
for r in rows:
    t = r["tflops"]
    print(f"{r['shape']:14} {t['hopper']:6.1f} {t['triton']:6.1f} {t['cudnn']:6.1f}   " + "   ".join("%.3f [%.3f, %.3f]" % r[k] for k in ("hopper_vs_cudnn", "triton_vs_cudnn", "hopper_vs_triton")))
