"Kernels of rtrainer.kernels against their float64 references, on a CPU through Triton's interpreter (TRITON_INTERPRET=1)."
import pytest, torch
from rtrainer import kernels as K

needs_kernels = pytest.mark.skipif(not K.KERNELS_CAN_RUN, reason="no GPU and TRITON_INTERPRET is not 1")
nan = float("nan")
OPS = ["rms_norm", "add_rms_norm", "rope", "swiglu", "embedding"]

def test_every_reference_op_has_a_kernel():
    for name in OPS: assert {"torch", "triton"} <= set(K.OPS[name]), name
    assert K.get_op("rms_norm", "triton") is K.rms_norm_triton

@needs_kernels
@pytest.mark.parametrize("n", [1, 77, 5003])
def test_vecadd_odd_sizes(n):
    a, b = torch.randn(n), torch.randn(n)
    out = torch.full_like(a, nan)
    K.vecadd(a, b, out=out)
    K.check_close(f"vecadd {n}", out, a.double() + b.double(), 1e-6)

@needs_kernels
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_op_parity_forward_backward(name, dtype):
    torch.manual_seed(0)
    res = K.check_op(name, "cpu", dtype)
    assert res["ok"], res

@needs_kernels
@pytest.mark.parametrize("shape", [(3, 5, 77), (7, 5), (2, 130), (41, 77)])  # 41 rows: several row blocks per backward program, the last one partial
@pytest.mark.parametrize("backward", [dict(RMS_NORM_BACKWARD_PREFETCH=1), dict(RMS_NORM_BACKWARD_PREFETCH=0),
                                      dict(RMS_NORM_BACKWARD_PREFETCH=1, RMS_NORM_BACKWARD_BLOCK_ROWS=2)])
def test_rms_norm_shapes_and_poison(shape, backward):
    x, w = torch.randn(*shape), torch.rand(shape[-1]) + 0.5
    y, _, rstd = K.rms_norm_forward(x, w, out=torch.full_like(x, nan))
    K.check_close(f"rms_norm {shape}", y, K.rms_norm_reference(x.double(), w.double()), 1e-5)
    dy = torch.randn_like(x)
    with K.knob_values(K, backward): dx, dw = K.rms_norm_backward(dy, x, w, rstd, dx=torch.full_like(x, nan))
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    K.rms_norm_reference(xd, wd).backward(dy.double())
    K.check_close("rms_norm dx", dx, xd.grad, 1e-5)
    K.check_close("rms_norm dweight", dw, wd.grad, 1e-5)
    assert dw.dtype == torch.float32

@needs_kernels
def test_rms_norm_non_contiguous_input():
    big = torch.randn(5, 3, 90)
    x, w = big[..., :77].requires_grad_(), (torch.rand(77) + 0.5).requires_grad_()   # rows strided by 90
    dy = torch.randn(5, 3, 77)
    y = K.rms_norm_triton(x, w); y.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = K.rms_norm_reference(xd, wd); ref.backward(dy.double())
    K.check_close("rms_norm strided", y, ref, 1e-5)
    K.check_close("rms_norm strided dx", x.grad, xd.grad, 1e-5)
    K.check_close("rms_norm strided dweight", w.grad, wd.grad, 1e-5)

@needs_kernels
def test_add_rms_norm_poisoned_outputs():
    x, r, w = torch.randn(3, 5, 77), torch.randn(3, 5, 77), torch.rand(77) + 0.5
    out, summed = torch.full_like(x, nan), torch.full_like(x, nan)
    K.rms_norm_forward(x, w, residual=r, out=out, summed=summed)
    ref_norm, ref_sum = K.add_rms_norm_reference(x.double(), r.double(), w.double())
    K.check_close("add_rms_norm out", out, ref_norm, 1e-5)
    K.check_close("add_rms_norm summed", summed, ref_sum, 1e-5)

@needs_kernels
def test_rope_in_place_strided_and_inverse():
    cos, sin = K.rope_tables(7, 12)
    qkv = torch.randn(2, 7, 9, 12)
    q = qkv[:, :, :3]
    expected = K.rope_reference(q.double(), cos.double(), sin.double())
    untouched, original = qkv[:, :, 3:].clone(), q.clone()
    K.rope_apply(q, cos, sin, out=q)                          # in place, inside the fused tensor
    K.check_close("rope in place", q, expected, 1e-5)
    assert torch.equal(qkv[:, :, 3:], untouched)
    K.check_close("rope inverse", K.rope_apply(q, cos, sin, inverse=True), original.double(), 1e-5)
    with pytest.raises(ValueError, match="tables"): K.rope_apply(torch.randn(2, 6, 3, 12), cos, sin)

@needs_kernels
@pytest.mark.parametrize("shape", [(3, 9, 5, 6), (1, 4, 2, 2), (2, 33, 3, 10)])
def test_rope_many_rows_odd_head_dims(shape):
    "More (position, head) rows than one program takes, the last block partial; head dims that are not powers of two."
    B, T, H, hd = shape
    cos, sin = K.rope_tables(T, hd)
    x = torch.randn(B, T, H, hd)
    out = K.rope_apply(x, cos, sin, out=torch.full_like(x, nan))
    K.check_close(f"rope {shape}", out, K.rope_reference(x.double(), cos.double(), sin.double()), 1e-5)

@needs_kernels
def test_swiglu_strided_rows_and_poison():
    big = torch.randn(3, 5, 100)
    g = big[..., :90]                                          # FF = 45, rows strided by 100
    out = torch.full((3, 5, 45), nan)
    K.check_close("swiglu strided", K.swiglu_forward(g, out=out), K.swiglu_reference(g.double()), 1e-5)
    dy = torch.randn(3, 5, 45)
    gd = g.double().requires_grad_(); K.swiglu_reference(gd).backward(dy.double())
    K.check_close("swiglu backward", K.swiglu_backward(dy, g, dgate_up=torch.full((3, 5, 90), nan)), gd.grad, 1e-5)
    with pytest.raises(ValueError, match="even"): K.swiglu_forward(torch.randn(2, 5))

def _expected_table_grad(ids, dy, V):
    return torch.zeros(V, dy.shape[-1], dtype=torch.float64).index_add_(0, ids.flatten(), dy.double().reshape(-1, dy.shape[-1]))

@needs_kernels
@pytest.mark.parametrize("variant", ["deterministic", "atomic"])
def test_embedding_overwrite_zeroes_untouched_rows(variant):
    V, D = 31, 77
    ids = torch.randint(0, V // 2, (3, 5)); ids[1] = 2        # upper half of the table never hit
    dy = torch.randn(3, 5, D)
    buf = torch.full((V, D), nan)
    K.EMBEDDING_BACKWARDS[variant](ids, dy, buf, True)
    expected = _expected_table_grad(ids, dy, V)
    K.check_close(f"embedding {variant} overwrite", buf, expected, 1e-5)
    assert (buf[V // 2:] == 0).all()
    K.EMBEDDING_BACKWARDS[variant](ids, dy, buf, False)
    K.check_close(f"embedding {variant} accumulate", buf, 2 * expected, 1e-5)

@needs_kernels
@pytest.mark.parametrize("variant", ["deterministic", "atomic"])
def test_embedding_autograd_writes_main_grad(variant, monkeypatch):
    monkeypatch.setattr(K, "EMBEDDING_BACKWARD", variant)
    V, D = 29, 33
    table = torch.nn.Parameter(torch.randn(V, D))
    ids1, ids2 = torch.randint(0, V, (2, 6)), torch.randint(0, V, (4, 3))
    dy1, dy2 = torch.randn(2, 6, D), torch.randn(4, 3, D)
    op = K.get_op("embedding", "triton")
    K.start_gradient_step([table]); table.main_grad = torch.full((V, D), nan)
    out = op(ids1, table)
    assert torch.equal(out, table.detach()[ids1])
    out.backward(dy1)
    op(ids2, table).backward(dy2)                              # second micro-batch adds
    assert table.grad is None
    K.check_close("embedding two micro-batches", K.gradient_fp32(table),
                  _expected_table_grad(ids1, dy1, V) + _expected_table_grad(ids2, dy2, V), 1e-5)
    K.start_gradient_step([table])                             # a new step overwrites
    op(ids2, table).backward(dy2)
    K.check_close("embedding new step", K.gradient_fp32(table), _expected_table_grad(ids2, dy2, V), 1e-5)

def test_sweep_variant_parsing():
    assert K.parse_variants("vecadd", ["BLOCK=1024,BLOCK=4096"]) == [{"VECADD_BLOCK": 1024}, {"VECADD_BLOCK": 4096}]
    assert K.parse_variants("embedding", ["BACKWARD=atomic BLOCK=256", "EMBEDDING_BLOCK=128"]) == [
        {"EMBEDDING_BACKWARD": "atomic", "EMBEDDING_BLOCK": 256}, {"EMBEDDING_BLOCK": 128}]
    with pytest.raises(ValueError, match="no knob"): K.parse_variants("vecadd", ["BLOK=3"])
    with pytest.raises(ValueError, match="KNOB=VALUE"): K.parse_variants("vecadd", ["BLOCK"])
    with pytest.raises(ValueError, match="no benchmark"): K.parse_variants("nope", ["BLOCK=1"])
    assert K.parse_size("33x77") == (33, 77)
    with pytest.raises(ValueError): K.parse_size("33by77")

def _cli(*argv):
    from rtrainer.cli import main
    return main(list(argv))

def test_machine_metadata_names_the_cpu(tmp_path, monkeypatch):
    "Every record carries the CPU's model and cores (`cpu`); without /proc/cpuinfo, the platform's word, and never an error."
    import os
    cores = f"({os.cpu_count()} cores)"
    info = tmp_path / "cpuinfo"; info.write_text("processor\t: 0\nvendor_id\t: Test\nmodel name\t: Test CPU 9000\n")
    assert K.cpu_description(info) == f"Test CPU 9000 {cores}"
    monkeypatch.setattr(K.platform, "processor", lambda: "")
    assert K.cpu_description(tmp_path / "missing") == f"CPU {cores}"
    info.write_bytes(b"model name\t: \xff\xfe\n")                     # unreadable as text
    assert K.cpu_description(info) == f"CPU {cores}"
    meta = K.machine_metadata()
    assert meta["cpu"].endswith(cores) and (torch.cuda.is_available() or meta["device"] == f"CPU {cores}")


def test_doctor_exits_zero(capsys):
    assert _cli("doctor", "--size", "1001") == 0
    out = capsys.readouterr().out
    assert "torch" in out and "kernels" in out and "vecadd" in out

@needs_kernels
def test_sweep_restores_knobs_and_prints(capsys):
    before = K.VECADD_BLOCK
    assert _cli("sweep", "vecadd", "BLOCK=256,BLOCK=1024", "--sizes", "3001") == 0
    assert K.VECADD_BLOCK == before
    out = capsys.readouterr().out
    assert "VECADD_BLOCK=256" in out and "VECADD_BLOCK=1024" in out

@needs_kernels
def test_bench_ops_and_kernel(capsys):
    assert _cli("bench", "ops") == 0
    assert _cli("bench", "rope", "--sizes", "2x3x2x6") == 0
    assert _cli("bench", "nope") == 2
    out = capsys.readouterr().out
    assert "swiglu" in out and "rope" in out


def test_enqueue_ms_times_the_host_between_two_synchronizations(monkeypatch):
    "Host time per call, synchronized before and after the calls and never between them."
    import time
    syncs, order = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(len(order)))
    def call(): order.append(1); time.sleep(0.004)
    ms = K.enqueue_ms(call, calls=5)
    assert len(order) == 5 and syncs == [0, 5]
    assert 3.5 < ms < 40


class SimulatedGPU:
    """A stand-in for torch.cuda with a clock: each launch runs after the previous one and never before the host enqueued
    it, events stamp the moment the device reaches them, `_sleep` spins. Host time is real (time.sleep)."""
    CYCLES_PER_MS = 1_000_000

    def __init__(self): self.busy_until = self.now()
    @staticmethod
    def now(): import time; return time.perf_counter() * 1e3
    def run(self, ms): self.busy_until = max(self.busy_until, self.now()) + ms
    def synchronize(self, *a):
        import time; time.sleep(max(0.0, self.busy_until - self.now()) / 1e3)
    def _sleep(self, cycles): self.run(cycles / self.CYCLES_PER_MS)
    def Event(self, enable_timing=False):
        gpu = self
        class Event:
            def record(self): self.at = max(gpu.busy_until, gpu.now())
            def synchronize(self): gpu.synchronize()
            def elapsed_time(self, end): return end.at - self.at
        return Event()

    def install(self, monkeypatch):
        for name in ("synchronize", "_sleep", "Event"): monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(K, "_spin_cycles_per_ms", {0: self.CYCLES_PER_MS})
        return self

    def call(self, host_ms, device_ms):
        "A call that takes host_ms on the host to enqueue device_ms of work."
        import time
        def fn(): time.sleep(host_ms / 1e3); self.run(device_ms)
        return fn


@pytest.mark.parametrize("host_ms,device_ms", [(0.05, 1.0), (2.0, 0.5)])
def test_median_ms_times_the_device_not_the_host(monkeypatch, host_ms, device_ms):
    "A host slower than the device (2 ms to enqueue 0.5 ms of work) must not show in median_ms: the spin hides it."
    gpu = SimulatedGPU().install(monkeypatch)
    ms = K.median_ms(gpu.call(host_ms, device_ms), warmup_ms=5, rep_ms=20)
    assert 0.9 * device_ms < ms < 1.25 * device_ms, (ms, host_ms, device_ms)


@pytest.mark.parametrize("host_ms,device_ms", [(0.05, 1.0), (2.0, 0.5)])
def test_sustained_ms_times_calls_back_to_back(monkeypatch, host_ms, device_ms):
    "Back to back with no spin: the device's time per call, or the host's where the host is the slower (it shows)."
    gpu = SimulatedGPU().install(monkeypatch)
    ms = K.sustained_ms(gpu.call(host_ms, device_ms), seconds=0.1, warmup_ms=5)
    expected = max(host_ms, device_ms)
    assert 0.9 * expected < ms < 1.6 * expected, (ms, host_ms, device_ms)
