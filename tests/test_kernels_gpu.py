"bf16 parity of rtrainer.kernels on a CUDA GPU against float64 references, on real-ish shapes: pytest -m cuda tests/test_kernels_gpu.py"
import pytest, torch, triton
from rtrainer import kernels as K

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
nan = float("nan")
bf16 = torch.bfloat16
OPS = ["rms_norm", "add_rms_norm", "rope", "swiglu", "embedding"]

def test_kernels_compile_not_interpret():
    assert not K.INTERPRETING, "unset TRITON_INTERPRET for the GPU tests"

@pytest.mark.parametrize("name", OPS)
def test_op_parity_bf16(name):
    torch.manual_seed(0)
    res = K.check_op(name, "cuda", bf16, scale="gpu")
    assert res["ok"], res

@pytest.mark.parametrize("name", OPS)
def test_op_parity_fp32(name):
    torch.manual_seed(1)
    res = K.check_op(name, "cuda", torch.float32, scale="small", tolerance=1e-5)
    assert res["ok"], res

@pytest.mark.parametrize("n", [1, 4097, 100_000_007])
def test_vecadd_poisoned(n):
    a, b = torch.randn(n, device="cuda", dtype=bf16), torch.randn(n, device="cuda", dtype=bf16)
    out = torch.full_like(a, nan)
    K.vecadd(a, b, out=out)
    K.check_close(f"vecadd {n}", out, a.double() + b.double(), 1e-2)

@pytest.mark.parametrize("shape", [(4096, 3072), (1000, 2048), (333, 8192), (517, 1000)])
@pytest.mark.parametrize("backward", [{}, dict(RMS_NORM_BACKWARD_PREFETCH=0), dict(RMS_NORM_BACKWARD_BLOCK_ROWS=2, RMS_NORM_BACKWARD_NUM_WARPS=32)])
def test_rms_norm_bf16_poisoned(shape, backward):
    x = torch.randn(*shape, device="cuda", dtype=bf16)
    r = torch.randn_like(x)
    w = torch.rand(shape[-1], device="cuda") + 0.5
    y, _, rstd = K.rms_norm_forward(x, w, out=torch.full_like(x, nan))
    K.check_close(f"rms_norm {shape}", y, K.rms_norm_reference(x.double(), w.double()), 1e-2)
    y2, s2, rstd2 = K.rms_norm_forward(x, w, residual=r, out=torch.full_like(x, nan), summed=torch.full_like(x, nan))
    ref_norm, ref_sum = K.add_rms_norm_reference(x, r, w.double())
    K.check_close("add_rms_norm summed", s2, ref_sum, 1e-2)
    K.check_close("add_rms_norm normed", y2, K.rms_norm_reference(ref_sum.double(), w.double()), 1e-2)
    dy, ds = torch.randn_like(x), torch.randn_like(x)
    with K.knob_values(K, backward): dx, dw = K.rms_norm_backward(dy, s2, w, rstd2, dsummed=ds, dx=torch.full_like(x, nan))
    sd, wd = s2.double().requires_grad_(), w.double().requires_grad_()
    K.rms_norm_reference(sd, wd).backward(dy.double())
    K.check_close("add_rms_norm dx", dx, sd.grad + ds.double(), 1e-2)
    K.check_close("add_rms_norm dweight", dw, wd.grad, 1e-3)
    assert dw.dtype == torch.float32

@pytest.mark.parametrize("B,T,H,hd", [(4, 1024, 12, 64), (2, 1024, 16, 128), (3, 77, 5, 10)])
def test_rope_bf16_qkv_slices(B, T, H, hd):
    cos, sin = K.rope_tables(T, hd, device="cuda")
    qkv = torch.randn(B, T, 3 * H, hd, device="cuda", dtype=bf16)
    for part in range(2):                                     # Q and K, as views of the fused tensor
        view = qkv[:, :, part * H:(part + 1) * H]
        out = torch.full(view.shape, nan, device="cuda", dtype=bf16)
        K.rope_apply(view, cos, sin, out=out)
        K.check_close(f"rope part {part}", out, K.rope_reference(view.double(), cos.double(), sin.double()), 1e-2)
        back = K.rope_apply(out, cos, sin, inverse=True, out=torch.full_like(out, nan))
        K.check_close("rope inverse", back, view, 1e-2)
    v = qkv[:, :, 2 * H:].clone()
    K.rope_apply(qkv[:, :, :H], cos, sin, out=qkv[:, :, :H])  # in place leaves V alone
    assert torch.equal(qkv[:, :, 2 * H:], v)

@pytest.mark.parametrize("rows,ff", [(8192, 1408), (1000, 5632), (77, 45)])
def test_swiglu_bf16_poisoned(rows, ff):
    g = torch.randn(rows, 2 * ff, device="cuda", dtype=bf16)
    out = K.swiglu_forward(g, out=torch.full((rows, ff), nan, device="cuda", dtype=bf16))
    K.check_close(f"swiglu {rows}x{ff}", out, K.swiglu_reference(g.double()), 1e-2)
    dy = torch.randn(rows, ff, device="cuda", dtype=bf16)
    gd = g.double().requires_grad_(); K.swiglu_reference(gd).backward(dy.double())
    K.check_close("swiglu backward", K.swiglu_backward(dy, g, dgate_up=torch.full_like(g, nan)), gd.grad, 1e-2)

@pytest.mark.parametrize("variant", ["deterministic", "atomic"])
def test_embedding_bf16_overwrite_and_accumulate(variant):
    V, D, N = 32004, 768, 16384
    ids = torch.randint(0, V // 2, (N,), device="cuda"); ids[: N // 4] = 13          # a frequent token; upper half never hit
    table = torch.randn(V, D, device="cuda", dtype=bf16)
    out = K.embedding_forward(ids, table, out=torch.full((N, D), nan, device="cuda", dtype=bf16))
    assert torch.equal(out, table[ids])
    dy = torch.randn(N, D, device="cuda", dtype=bf16)
    expected = torch.zeros(V, D, device="cuda", dtype=torch.float64).index_add_(0, ids, dy.double())
    buf = torch.full((V, D), nan, device="cuda")
    K.EMBEDDING_BACKWARDS[variant](ids, dy, buf, True)
    K.check_close(f"embedding {variant} overwrite", buf, expected, 1e-5)
    assert (buf[V // 2:] == 0).all()
    K.EMBEDDING_BACKWARDS[variant](ids, dy, buf, False)
    K.check_close(f"embedding {variant} accumulate", buf, 2 * expected, 1e-5)

def test_embedding_deterministic_is_bitwise_repeatable():
    differing = K.embedding_run_to_run_differences()
    print("differing elements:", differing)
    assert differing["deterministic"] == 0

def test_benchmark_rows_have_figures():
    rows = K.BENCHMARKS["rms_norm"]["run"]((4096, 3072), bf16, "cuda", False)
    assert [r["passes"] for r in rows] == ["fwd", "fwd+bwd"]
    assert all(r["GBps"] > 0 and r["ms"] > 0 for r in rows)

def test_cli_on_gpu(capsys):
    from rtrainer.cli import main
    assert main(["doctor"]) == 0
    assert main(["bench", "ops"]) == 0
    assert main(["sweep", "rms_norm", "BLOCK_ROWS=1,BLOCK_ROWS=2", "--sizes", "8192x3072"]) == 0
    out = capsys.readouterr().out
    assert "compiled (CUDA)" in out and "RMS_NORM_BLOCK_ROWS=2" in out

@pytest.mark.serial
def test_median_ms_times_the_device_not_the_host():
    "Two milliseconds of host work per call must not show up in the device time of a ~0.1 ms copy."
    import time
    from rtrainer.kernels import median_ms
    x = torch.randn(2 ** 26, device="cuda"); y = torch.empty_like(x)           # 512 MB moved per copy
    def copy(): y.copy_(x)
    def slow_host_copy(): time.sleep(0.002); y.copy_(x)
    fast, slow = median_ms(copy), median_ms(slow_host_copy)
    print(f"copy {fast:.4f} ms, with 2 ms of host work per call {slow:.4f} ms")
    assert 0.05 < fast < 1.0 and slow < 1.3 * fast + 0.02

@pytest.mark.serial
def test_sustained_ms_times_calls_back_to_back():
    "A 2 ms spin kernel queued back to back: about 2 ms a call; with 2 ms of host work per call the host shows (no spin hides it)."
    import time
    from rtrainer.kernels import sustained_ms, _cycles_per_ms
    cycles = int(2.0 * _cycles_per_ms())
    def spin(): torch.cuda._sleep(cycles)
    def slow_host_spin(): time.sleep(0.004); torch.cuda._sleep(cycles)
    ms, host_bound = sustained_ms(spin, seconds=0.3), sustained_ms(slow_host_spin, seconds=0.3)
    print(f"spin {ms:.3f} ms, with 4 ms of host work per call {host_bound:.3f} ms")
    assert 1.8 < ms < 2.2 and host_bound > 3.8

def test_resident_programs_reads_the_compiled_kernel():
    "Occupancy from the compiled kernel: a light 4-warp kernel is thread-bound (2048 threads per SM), a register-heavy one fewer."
    a = torch.randn(4096, device="cuda")
    light = K.vecadd_kernel.warmup(a, a, a, a.numel(), BLOCK=1024, num_warps=4, grid=(1,))
    props = torch.cuda.get_device_properties(0)
    assert K.resident_programs(light, a.device) == props.max_threads_per_multi_processor // 128
    x = torch.randn(64, 4096, device="cuda", dtype=bf16); w = torch.rand(4096, device="cuda") + 0.5
    K._RESIDENT.clear()
    y, _, rstd = K.rms_norm_forward(x, w)
    with K.knob_values(K, dict(RMS_NORM_BACKWARD_NUM_WARPS=4)): K.rms_norm_backward(torch.randn_like(x), x, w, rstd)
    (per_sm,) = K._RESIDENT.values()
    assert 1 <= per_sm < 16, per_sm   # 4 warps over 4096 columns hold 32 values of each row per thread: registers bind first

@pytest.mark.parametrize("dtype", [torch.float32, bf16])
def test_launch_direct_path_writes_what_the_bound_path_does(dtype):
    "K.launch: the first launch of a key binds, the next ones go direct, to fresh tensors, and an odd alignment is its own key."
    base = torch.randn(3 * 8192 + 8, device="cuda", dtype=dtype)
    cases = [(n, off) for n in (1, 77, 4097) for off in (0, 1)]          # off 1: every pointer 2 or 4 bytes off alignment
    for round_ in range(3):
        for n, off in cases:
            a, b = torch.randn(n + off, device="cuda", dtype=dtype)[off:], base[off:off + n]
            out = torch.full((n + off,), nan, device="cuda", dtype=dtype)[off:]
            before = dict(K.LAUNCH_COUNTS)
            K.launch(K.vecadd_kernel, (triton.cdiv(n, 256),), a, b, out, n, BLOCK=256, num_warps=4)
            path = "direct" if K.LAUNCH_COUNTS["direct"] > before["direct"] else "bound"
            assert round_ == 0 or path == "direct", (n, off, round_)
            K.check_close(f"launch vecadd {dtype} n={n} off={off} ({path})", out, a.double() + b.double(), 1e-2)
    x = torch.randn(80, device="cuda", dtype=dtype)                     # fresh from the allocator: aligned
    assert K.launch_key(K.vecadd_kernel, 0, (x, x, x, 77), {}) != K.launch_key(K.vecadd_kernel, 0, (x[1:], x, x, 77), {})

def test_launch_remembers_a_key_that_cannot_go_direct(monkeypatch):
    "A keyword argument that is not a constexpr (n=) binds every launch, right, and the signature is read once per key."
    monkeypatch.setattr(K, "_LAUNCHES", {})
    tails, constant_tail = [], K._constant_tail
    monkeypatch.setattr(K, "_constant_tail", lambda *a: tails.append(a[1:]) or constant_tail(*a))
    for n in (77, 4097, 77, 4097, 77):
        a, b = torch.randn(n, device="cuda", dtype=bf16), torch.randn(n, device="cuda", dtype=bf16)
        out = torch.full((n,), nan, device="cuda", dtype=bf16)
        before = dict(K.LAUNCH_COUNTS)
        K.launch(K.vecadd_kernel, (triton.cdiv(n, 256),), a, b, out, n=n, BLOCK=256, num_warps=4)
        assert K.LAUNCH_COUNTS["direct"] == before["direct"] and K.LAUNCH_COUNTS["bound"] == before["bound"] + 1, n
        K.check_close(f"launch vecadd n={n} by keyword", out, a.double() + b.double(), 1e-2)
    assert len(tails) == 2 and set(K._LAUNCHES.values()) == {K._BOUND}, (tails, K._LAUNCHES)
