"Model chapter: reference ops under float64 gradcheck, config validation and JSON, generation."
import json
import pytest, torch
from rtrainer.kernels import rms_norm_reference, add_rms_norm_reference, rope_reference, rope_tables, swiglu_reference
from rtrainer.attention import attention_reference
from rtrainer.matmul import linear_cross_entropy_reference
from rtrainer.model import ModelConfig, TransformerLm, model_config, parameter_counts, flops_per_token, naive_lm_loss, generate, PRESETS


def dbl(*shape): return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def test_reference_ops_gradcheck():
    x, w = dbl(2, 3, 7), (torch.rand(7, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_reference(a, b), (x, w))
    r = dbl(2, 3, 7)
    assert torch.autograd.gradcheck(lambda a, b, c: add_rms_norm_reference(a, b, c)[0], (x, r, w))
    cos, sin = rope_tables(5, 6)
    assert torch.autograd.gradcheck(lambda a: rope_reference(a, cos.double(), sin.double()), (dbl(2, 5, 3, 6),))
    assert torch.autograd.gradcheck(swiglu_reference, (dbl(3, 10),))
    q, k, v = dbl(1, 5, 4, 6), dbl(1, 5, 2, 6), dbl(1, 5, 2, 6)
    assert torch.autograd.gradcheck(attention_reference, (q, k, v))
    h, hw = dbl(6, 4), dbl(4, 8)
    t = torch.tensor([0, 3, 4, -100, 2, 1])
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy_reference(a, b, t, 5), (h, hw))


@pytest.mark.parametrize("kv", [1, 2, 6])
def test_model_matches_naive_float64(kv):
    cfg = model_config("tiny", vocab_size=67, d_model=24, n_heads=6, n_kv_heads=kv, head_dim=4, d_ff=20, max_seq_len=32, impl="torch", seed=kv)
    m = TransformerLm(cfg, device="cpu").double()
    ids = torch.randint(0, 67, (2, 11))
    loss, _, _ = m(ids[:, :-1], ids[:, 1:]); loss.backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}; m.zero_grad()
    naive = naive_lm_loss(m, ids[:, :-1], ids[:, 1:]); naive.backward()
    assert abs(loss.item() - naive.item()) < 1e-10
    for n, p in m.named_parameters():
        assert ((p.grad - grads[n]).norm() / p.grad.norm()).item() < 1e-8, n  # fp32 RoPE tables


def test_loss_mask_counts_only_masked_positions():
    m = TransformerLm(model_config("tiny", impl="torch"), device="cpu")
    ids = torch.randint(0, 50257, (2, 9)); inp, tgt = ids[:, :-1], ids[:, 1:]
    mask = torch.zeros_like(tgt, dtype=torch.bool); mask[:, 5:] = True
    masked, _, _ = m(inp, tgt, mask)
    manual = torch.nn.functional.cross_entropy((m.hidden_states(inp) @ m.lm_head)[..., :50257][:, 5:].reshape(-1, 50257), tgt[:, 5:].reshape(-1))
    assert torch.allclose(masked, manual, atol=1e-5)


@pytest.mark.parametrize("bad, message", [
    (dict(n_heads=12, n_kv_heads=5), "multiple of n_kv_heads"), (dict(head_dim=7), "even"),
    (dict(d_model=0), "d_model"), (dict(n_layers=-1), "n_layers"), (dict(impl="cuda"), "impl"),
    (dict(n_experts=4, top_k=5, expert_d_ff=8), "top_k"), (dict(n_experts=4, expert_d_ff=0), "expert_d_ff"),
    (dict(padded_vocab_size=100), "padded_vocab_size")])
def test_config_validation_errors(bad, message):
    with pytest.raises(ValueError, match=message): ModelConfig(**bad).validate()


def test_config_json_round_trip_and_unknown_fields(tmp_path):
    c = model_config("tiny_moe")
    c.save(tmp_path / "c.json")
    assert ModelConfig.load(tmp_path / "c.json") == c
    (tmp_path / "bad.json").write_text(json.dumps({**c.to_dict(), "colour": 3}))
    with pytest.raises(ValueError, match="colour"): ModelConfig.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="unknown model config"): model_config("nope")
    with pytest.raises(FileNotFoundError): ModelConfig.load(tmp_path / "missing.json")


def test_parameter_and_flop_accounting():
    c = model_config("moe4b")
    pc = parameter_counts(c)
    assert (pc["embedding"], pc["lm_head"], pc["total"]) == (154_389_504, 154_927_104, 4_386_551_808)
    d = model_config("dense1b")
    n = parameter_counts(d)
    matmul = n["total"] - n["embedding"] - n["norms"]
    assert flops_per_token(d, 1024) == 6 * matmul + 12 * 24 * 1024 * 16 * 128
    # an MoE token pays for its top-k experts and the router only
    active_ffn = 12 * (2 * 3 * 3072 * 4096 + 3072 * 8)
    attn = 12 * (3072 * 3 * 3072 + 3072 * 3072)
    assert flops_per_token(c, 1024) == 6 * (active_ffn + attn + 3072 * 50432) + 12 * 12 * 1024 * 48 * 64
    tiny = TransformerLm(model_config("tiny_moe", impl="torch"), device="cpu")
    assert sum(p.numel() for p in tiny.parameters()) == parameter_counts(tiny.config)["total"]


def test_generate_is_deterministic_and_checks_arguments():
    m = TransformerLm(model_config("tiny", impl="torch"), device="cpu")
    assert generate(m, [10, 20], 6, seed=1) == generate(m, [10, 20], 6, seed=1)
    assert len(generate(m, [10], 5, temperature=0)) == 5
    with pytest.raises(ValueError, match="max_new_tokens"): generate(m, [1], 0)
    with pytest.raises(ValueError, match="empty"): generate(m, [], 3)


def test_sequence_longer_than_max_is_refused():
    m = TransformerLm(model_config("tiny", max_seq_len=8, impl="torch"), device="cpu")
    ids = torch.randint(0, 100, (1, 10))
    with pytest.raises(ValueError, match="max_seq_len"): m(ids[:, :-1], ids[:, 1:])


class Built(BaseException):
    "Raised in place of building a model: carries the config an entry point resolved (no multi-GB model on a CPU)."


@pytest.mark.parametrize("preset", ["rb100m", "prof183m", "dense1b", "moe4b"])
def test_every_entry_point_builds_the_preset_as_specified(preset, monkeypatch, tmp_path):
    """`train`, `profile`, `versus`, `sweep-arch` and the Python API resolve one configuration per preset: the same shapes
    and parameter count (an unset --vocab-size used to reset the preset's lm-head padding, 50,432 -> 50,304)."""
    from rtrainer import model as model_module, profiling, training
    from rtrainer.cli import build_parser
    from rtrainer.training import run_train
    def capture(self, cfg, *a, **k): raise Built(cfg)
    monkeypatch.setattr(model_module.TransformerLm, "__init__", capture)
    monkeypatch.setattr(training, "CPU_MAX_PARAMETERS", float("inf"))   # train refuses a GPU-sized model on a CPU; here nothing is built
    monkeypatch.setattr(profiling.PlainTransformer, "__init__", capture)
    def built(call):
        with pytest.raises(Built) as e: call()
        return e.value.args[0]
    parse = build_parser().parse_args
    configs = {
        "api": model_config(preset),
        "train": built(lambda: run_train(parse(["train", preset, "--data", "synthetic", "--device", "cpu", "--out-dir", str(tmp_path)]))),
        "profile": built(lambda: profiling._profile_report(parse(["profile", "--config", preset]))),
        "versus": built(lambda: profiling.versus(preset, tiers=("eager",), rounds=1, steps=1, warmup=0, save=False, isolate=False, log=lambda *a: None)),
        "sweep-arch": built(lambda: profiling.sweep_arch(preset, isolate=False, log=lambda *a: None)),
    }
    expected = {"rb100m": None, "prof183m": None, "dense1b": None, "moe4b": 4_386_551_808}[preset]
    shape = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("impl", "max_seq_len")}
    for entry, c in configs.items():
        assert shape(c) == shape(configs["api"]), (entry, shape(c))
        assert parameter_counts(c)["total"] == parameter_counts(configs["api"])["total"], entry
    assert configs["api"].padded_vocab_size == PRESETS[preset].get("padded_vocab_size", configs["api"].padded_vocab_size)
    if expected: assert parameter_counts(configs["api"])["total"] == expected


def test_tied_embeddings_one_table_feeds_both_gradients():
    """rb100m ties its lm-head to the embedding (101.7M parameters, RustingBrain's count): one (VP, D) table, whose fp32
    gradient sums the embedding's and the classifier's, as float64 autograd of the same model says."""
    import dataclasses
    from rtrainer.kernels import KERNELS_CAN_RUN, gradient_fp32
    counts = parameter_counts(model_config("rb100m"))
    assert counts["lm_head"] == 0 and counts["total"] == 101_720_832
    cfg = model_config("tiny", vocab_size=500, n_layers=2, tie_embeddings=True)      # VP 512: 12 padded rows
    ids = torch.randint(0, 500, (2, 19))
    grads = {}
    for impl in ("torch", "triton") if KERNELS_CAN_RUN else ("torch",):
        model = TransformerLm(dataclasses.replace(cfg, impl=impl), device="cpu")
        assert "lm_head" not in dict(model.named_parameters()) and model.embedding.shape == (512, 64)
        assert model.lm_head.shape == (64, 512) and model.lm_head.data_ptr() == model.embedding.data_ptr()
        model(ids[:, :-1], ids[:, 1:])[0].backward()
        grads[impl] = gradient_fp32(model.embedding)
    exact = TransformerLm(dataclasses.replace(cfg, impl="torch"), device="cpu").double()
    naive_lm_loss(exact, ids[:, :-1], ids[:, 1:]).backward()
    for impl, g in grads.items():
        err = ((g.double() - exact.embedding.grad).norm() / exact.embedding.grad.norm()).item()
        print(f"{impl}: tied table gradient, relative error {err:.1e} against float64")
        assert err < 1e-5, impl
        assert (g[500:] == 0).all()          # padded rows: never looked up, their logits never counted
