"CPU tests of rtrainer.matmul: Triton kernels through the interpreter (fp32/fp16 operands), against float64."
import types
import pytest, torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
import rtrainer.matmul as mm
from rtrainer.kernels import get_op, start_gradient_step, gradient_fp32, relative_error

needs_triton = pytest.mark.skipif(not mm.KERNELS_CAN_RUN, reason="needs TRITON_INTERPRET=1 or a GPU")


@pytest.fixture(params=["cublas", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton" and not mm.KERNELS_CAN_RUN: pytest.skip("needs the interpreter")
    monkeypatch.setattr(mm, "GEMM_DEFAULT_BACKEND", request.param)
    return request.param

@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("M,N,K,a_transposed,b_transposed", [(37, 29, 45, False, False), (19, 53, 33, True, False),
                                                              (50, 17, 70, False, True), (1, 5, 3, True, True)])
def test_triton_matmul_matches_float64(dtype, tol, M, N, K, a_transposed, b_transposed):
    a = torch.randn(K, M).t() if a_transposed else torch.randn(M, K)
    b = torch.randn(N, K).t() if b_transposed else torch.randn(K, N)
    a, b = a.to(dtype), b.to(dtype)
    out = torch.full((M, N), float("nan"), dtype=dtype)
    mm.triton_matmul(a, b, out=out)
    assert not out.isnan().any()
    assert relative_error(out, a.double() @ b.double()) < tol

@needs_triton
def test_triton_matmul_accumulates_into_fp32():
    a, b = torch.randn(23, 41).half(), torch.randn(41, 31).half()
    out = torch.randn(23, 31)
    expected = out.double() + a.double() @ b.double()
    mm.triton_matmul(a, b, out=out, accumulate=True)
    assert relative_error(out, expected) < 1e-3
    poisoned = torch.full((23, 31), float("nan"))
    mm.gemm_into_fp32(a.float(), b.float(), poisoned, accumulate=False)
    assert relative_error(poisoned, a.double() @ b.double()) < 1e-5

def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="do not chain"): mm.triton_matmul(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="features"): mm.linear_fp32_weight_grad(torch.randn(3, 4), torch.randn(5, 6))
    with pytest.raises(ValueError, match="vocab_size"):
        mm.linear_cross_entropy(torch.randn(3, 4), torch.randn(4, 8), torch.zeros(3, dtype=torch.long), 9)

def test_linear_registered():
    assert get_op("linear", "triton") is mm.linear_fp32_weight_grad
    assert get_op("linear_cross_entropy", "triton") is mm.linear_cross_entropy

def test_linear_main_grad_accumulates_then_overwrites(backend):
    weight = torch.nn.Parameter(torch.randn(13, 11))
    xs = [torch.randn(3, 5, 13, requires_grad=True) for _ in range(3)]
    dys = [torch.randn(3, 5, 11) for _ in range(3)]
    flat = lambda t: t.detach().double().reshape(-1, t.shape[-1])
    start_gradient_step([weight])
    for x, dy in zip(xs[:2], dys[:2]):
        y = mm.linear_fp32_weight_grad(x, weight)
        assert relative_error(y, x.detach().double() @ weight.detach().double()) < 1e-6
        y.backward(dy)
    assert weight.grad is None and weight.main_grad.dtype == torch.float32
    assert relative_error(gradient_fp32(weight), sum(flat(x).t() @ flat(dy) for x, dy in zip(xs[:2], dys[:2]))) < 1e-6
    for x, dy in zip(xs[:2], dys[:2]): assert relative_error(x.grad, dy.double() @ weight.detach().double().t()) < 1e-6
    buffer = weight.main_grad
    start_gradient_step([weight])                      # new step: overwrite, the old sum must not leak in
    mm.linear_fp32_weight_grad(xs[2], weight).backward(dys[2])
    assert weight.main_grad is buffer                  # same buffer, no reallocation, no zero-fill
    assert relative_error(weight.main_grad, flat(xs[2]).t() @ flat(dys[2])) < 1e-6

def _fused_vs_reference(N, D, V, VP, chunk_rows, monkeypatch, micro_batches=2, scale=3.0, transposed=False):
    monkeypatch.setattr(mm, "CE_CHUNK_ROWS", chunk_rows)
    head = torch.nn.Parameter(torch.randn(*((VP, D) if transposed else (D, VP))) / D**0.5)   # (VP, D): a tied embedding table
    head64 = head.detach().double().requires_grad_()
    start_gradient_step([head])
    for _ in range(micro_batches):
        hidden = (2 * torch.randn(N, D)).requires_grad_()
        targets = torch.randint(0, V, (N,)); targets[::4] = mm.IGNORE_INDEX; targets[1] = V - 1
        loss = mm.linear_cross_entropy(hidden, head, targets, V, weight_transposed=transposed)
        hidden64 = hidden.detach().double().requires_grad_()
        ref = mm.linear_cross_entropy_reference(hidden64, head64, targets, V, weight_transposed=transposed)
        (scale * loss).backward(); (scale * ref).backward()
        assert relative_error(loss, ref.detach()) < 1e-5
        assert relative_error(hidden.grad, hidden64.grad) < 1e-5
    assert head.grad is None
    assert relative_error(gradient_fp32(head), head64.grad) < 1e-5

def test_fused_cross_entropy_matches_float64_in_chunks(backend, monkeypatch):
    _fused_vs_reference(N=37, D=9, V=61, VP=64, chunk_rows=8, monkeypatch=monkeypatch)

def test_fused_cross_entropy_with_a_tied_table(backend, monkeypatch):
    "The weight given as a (VP, D) embedding table: same loss, and its fp32 gradient in the table's layout."
    _fused_vs_reference(N=37, D=9, V=61, VP=64, chunk_rows=8, monkeypatch=monkeypatch, transposed=True)

def test_fused_cross_entropy_one_chunk_one_micro_batch(monkeypatch):
    _fused_vs_reference(N=21, D=5, V=17, VP=17, chunk_rows=8192, monkeypatch=monkeypatch, micro_batches=1, scale=1.0)

@needs_triton
def test_row_kernel_matches_torch_version():
    V, VP = 75, 80
    logits = torch.randn(11, VP) * 4
    targets = torch.randint(0, V, (11,)); targets[3] = mm.IGNORE_INDEX
    inv_count = torch.tensor([1 / 10])
    results = []
    for fn in (mm.cross_entropy_rows, mm.cross_entropy_rows_torch):
        chunk, row_loss = logits.clone(), torch.full((11,), float("nan"))
        fn(chunk, targets, row_loss, inv_count, V, mm.IGNORE_INDEX, True)
        results.append((chunk, row_loss))
    (chunk_k, loss_k), (chunk_t, loss_t) = results
    assert not chunk_k.isnan().any() and not loss_k.isnan().any()
    assert relative_error(loss_k, loss_t) < 1e-6 and relative_error(chunk_k, chunk_t) < 1e-6
    assert (chunk_k[:, V:] == 0).all() and (chunk_k[3] == 0).all() and loss_k[3] == 0
    # each valid row's gradient sums to 0 (softmax sums to 1, minus the one-hot)
    assert chunk_k.sum(1).abs().max() < 1e-6

def test_ignored_targets_do_not_count(monkeypatch):
    hidden, head = torch.randn(9, 4), torch.randn(4, 10)
    targets = torch.randint(0, 10, (9,))
    some_ignored = targets.clone(); some_ignored[:5] = mm.IGNORE_INDEX
    loss = mm.linear_cross_entropy(hidden, head, some_ignored, 10)
    expected = F.cross_entropy((hidden @ head)[5:].double(), targets[5:])
    assert relative_error(loss, expected) < 1e-6

class LargestTensor(TorchDispatchMode):
    "Records the largest tensor (in bytes) any op produces (the interpreter copies storages as bytes)."
    def __init__(self): super().__init__(); self.largest = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor): self.largest = max(self.largest, t.numel() * t.element_size())
        return out

def test_full_logits_never_exist(monkeypatch):
    "The memory property: no tensor of N x VP elements is ever created, forward or backward; the reference does create one."
    N, D, V, VP, chunk = 96, 8, 250, 256, 16
    monkeypatch.setattr(mm, "CE_CHUNK_ROWS", chunk)
    hidden, head = torch.randn(N, D, requires_grad=True), torch.nn.Parameter(torch.randn(D, VP))
    targets = torch.randint(0, V, (N,))
    start_gradient_step([head])
    with LargestTensor() as fused:
        mm.linear_cross_entropy(hidden, head, targets, V).backward()
    with LargestTensor() as reference:
        mm.linear_cross_entropy_reference(hidden, head, targets, V).backward()
    print("largest tensor (bytes): fused", fused.largest, "reference", reference.largest, "N*VP fp32", N * VP * 4)
    assert reference.largest >= N * V * 4
    assert fused.largest <= max(chunk * VP, N * D, D * VP) * 4

def test_no_grad_leaves_main_grad_alone():
    head = torch.nn.Parameter(torch.randn(6, 16))
    hidden, targets = torch.randn(10, 6), torch.randint(0, 13, (10,))
    start_gradient_step([head])
    with torch.no_grad(): loss = mm.linear_cross_entropy(hidden, head, targets, 13)
    assert relative_error(loss, mm.linear_cross_entropy_reference(hidden.double(), head.detach().double(), targets, 13)) < 1e-6
    assert gradient_fp32(head) is None

def test_gemm_shapes_cover_the_matmul_parameters():
    for name, expected in (("rb100m", 101_695_488), ("dense1b", None)):
        cfg = mm.MODEL_SHAPES[name]
        shapes = mm.gemm_shapes(cfg)
        assert len(shapes) == 15 and len({s[0] for s in shapes}) == 15
        per_layer = {"qkv", "attn_out", "gate_up", "down"}
        weights = sum(N * K * (cfg["n_layers"] if n.split(".")[0] in per_layer else 1) for n, M, N, K in shapes if n.endswith(".fwd"))
        D, FF, hd = cfg["d_model"], cfg["d_ff"], cfg["head_dim"]
        formula = cfg["n_layers"] * (D * (cfg["n_heads"] + 2 * cfg["n_kv_heads"]) * hd + cfg["n_heads"] * hd * D + 3 * D * FF) + D * cfg["padded_vocab_size"]
        assert weights == formula and (expected is None or weights == expected)
        for n, M, N, K in shapes:   # the three GEMMs of a linear have the same FLOPs
            assert M * N * K == next(m * nn * k for nm, m, nn, k in shapes if nm == n.rsplit(".", 1)[0] + ".fwd")
    as_object = types.SimpleNamespace(**mm.MODEL_SHAPES["rb100m"])
    assert mm.gemm_shapes(as_object) == mm.gemm_shapes(mm.MODEL_SHAPES["rb100m"])
    moe = {name: M for name, M, N, K in mm.gemm_shapes(mm.MODEL_SHAPES["moe4b"])}
    assert len(moe) == 18 and "gate_up.fwd" not in moe
    assert moe["expert_gate_up.fwd"] == 16 * 1024 * 2 // 8 and moe["router.fwd"] == 16 * 1024
    assert mm.gemm_shapes(mm.MODEL_SHAPES["rb100m"], batch_size=2)[0][1] == 2048
    # a ModelConfig-like object: max_seq_len, no batch size, some dense layers and a shared expert
    model_like = types.SimpleNamespace(vocab_size=1000, padded_vocab_size=0, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                                       head_dim=16, d_ff=96, max_seq_len=32, n_experts=4, top_k=2, expert_d_ff=48,
                                       moe_layers=(1, 4), shared_expert=True, capacity_factor=1.25)
    with pytest.raises(ValueError, match="batch_size"): mm.gemm_shapes(model_like)
    shapes = {name: (M, N, K) for name, M, N, K in mm.gemm_shapes(model_like, batch_size=3)}
    assert shapes["lm_head.fwd"] == (96, 1024, 64) and shapes["gate_up.fwd"] == (96, 192, 64)
    assert shapes["expert_down.wgrad"] == (48, 64, 60) and shapes["shared_gate_up.fwd"] == (96, 96, 64)

def test_gemm_bench_needs_a_gpu(capsys):
    if torch.cuda.is_available(): pytest.skip("has a GPU")
    assert mm.run_gemm_bench("rb100m") == 1
    assert "CUDA" in capsys.readouterr().err


def test_model_shapes_match_the_model_presets():
    "matmul sits below the model chapter, so it keeps its own table of the reference shapes; it must not drift."
    from rtrainer.model import model_config, REFERENCE_BATCH
    for name, shape in mm.MODEL_SHAPES.items():
        cfg = model_config(name)
        for key, value in shape.items():
            if key == "batch_size": assert value == REFERENCE_BATCH[name], name
            elif key != "seq_len": assert getattr(cfg, key) == value, (name, key)
