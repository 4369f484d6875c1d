"""The Python side of an attention step's host time, on a machine without a GPU: the package's forward + backward
through its Hopper path, with what needs a GPU replaced (the device checks answer as an H100 would, and each launch
works out its key and looks up its launcher as `kernels.launch` does, then calls a launcher that does nothing). The
CUDA side (the driver's launches, TMA descriptors encoded by Triton's launcher, the caching allocator) is not in it.

Why: `attention_host_cost.py` measures the whole host time on the GPU machine, where device time is scarce; this
isolates the part that changes with the package's own Python, so a change to it can be compared on any machine.
Two trees are compared by `attention_host_ab.py`, which runs this stand-in when there is no GPU; this script itself
times the rtrainer beside it, the step and its parts.

Run: `python experiments/attention_host_sim.py [--profile]` with Triton 3.6 on the path (the GPU machine's; the
Gluon descriptors of other versions check other things). Prints host microseconds a step and a call, the median of
5 batches; `--profile` adds a cProfile of the `dense1b` step (sorted by SORT, tottime by default, its TOP rows, 20). Small shapes: the Python path does not depend on them.

This is an experiment, not part of rtrainer."""
import cProfile, inspect, io, os, pstats, statistics, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import rtrainer.attention as A
import rtrainer.attention_hopper as H
from rtrainer import kernels as K
from attention_host_cost import EmptyFunction          # the floor of a Python Function's forward + backward, as on the GPU

SHAPES = dict(rb100m=(2, 128, 12, 4, 64), prof183m=(2, 128, 24, 24, 64), dense1b=(2, 128, 16, 16, 128), moe4b=(2, 128, 48, 48, 64))

def as_on_a_gpu():
    "Let the Hopper path take CPU tensors: the device checks answer as an H100's would, and launches do nothing."
    A.KERNELS_CAN_RUN = True
    H._is_sm90 = lambda index: True
    H._sm_count = lambda index: 132
    def refusal(q, k, v, causal=True):                  # hopper_refusal without "not on a CUDA device"
        if not H.ENABLED: return "disabled"
        if not causal: return "not causal"
        if q.dtype != torch.bfloat16: return f"{q.dtype}, not bf16"
        if q.shape[-1] not in H.FORWARD_TILES: return f"head dim {q.shape[-1]}"
        for name, t in (("q", q), ("k", k), ("v", v)):
            if (why := H.tma_refusal(t)): return f"{name}: {why}"
        return None
    assert "if not q.is_cuda:" in inspect.getsource(H.hopper_refusal), "hopper_refusal changed: update the copy above"
    H.hopper_refusal = refusal
    launchers = {}
    def launch(kernel, grid, *args, **kwargs):          # kernels.launch's direct path, with a launcher that does nothing
        key = K.launch_key(kernel, 0, args, kwargs)
        entry = launchers.get(key)
        if entry is None: launchers[key] = entry = (lambda *a: None, None, None, (), lambda device: 0)
        run, function, metadata, tail, stream = entry
        g = (*grid, 1, 1)
        run(g[0], g[1], g[2], stream(0), function, metadata, None, None, None, *args, *tail)
    H.launch = A.launch = launch
    return refusal

def host_us(fn, calls=2000):
    "Median over 5 batches of microseconds per `fn()`, after 20 calls of warm-up."
    for _ in range(20): fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(times)

def main():
    refusal = as_on_a_gpu()
    print(f"{'shape':9} {'Hopper kernels':16} {'step':>6} {'empty Fn':>8} {'forward':>8} {'dQ':>6} {'dK/dV':>6} {'descriptor':>10} {'refusal':>8}   (us)")
    for name, (B, T, heads, KV, hd) in SHAPES.items():
        q = torch.randn(B, T, heads, hd, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, T, KV, hd, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        do = torch.randn(B, T, heads, hd, dtype=torch.bfloat16)
        step = lambda: torch.autograd.grad(A.flash_attention(q, k, v), (q, k, v), do)
        H.CALLS.clear(); step()
        hopper = "+".join(kind for kind in ("forward", "dq", "dkdv") if H.CALLS[kind])
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        o, lse = A.flash_attention_forward(qd, kd, vd)
        dq, delta = A.flash_backward_dq(do, qd, kd, vd, o, lse)
        us = dict(step=host_us(step), empty=host_us(lambda: torch.autograd.grad(EmptyFunction.apply(q, k, v), (q,), do)),
                  forward=host_us(lambda: A.flash_attention_forward(qd, kd, vd)),
                  dq=host_us(lambda: A.flash_backward_dq(do, qd, kd, vd, o, lse)),
                  dkdv=host_us(lambda: A.flash_backward_dkdv(do, qd, kd, vd, lse, delta)),
                  descriptor=host_us(lambda: H._descriptor(qd, 64)), refusal=host_us(lambda: refusal(qd, kd, vd)))
        print(f"{name:9} {hopper:16} {us['step']:6.1f} {us['empty']:8.1f} {us['forward']:8.1f} {us['dq']:6.1f} {us['dkdv']:6.1f}"
              f" {us['descriptor']:10.1f} {us['refusal']:8.1f}", flush=True)
        if name == "dense1b" and "--profile" in sys.argv:
            profile = cProfile.Profile(); profile.enable()
            for _ in range(2000): step()
            profile.disable()
            text = io.StringIO(); pstats.Stats(profile, stream=text).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", 20)))
            print(text.getvalue())

if __name__ == "__main__":
    main()
