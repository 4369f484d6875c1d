"""Export chapter: every checkpoint form to one file, int8 weights, transformers folders (Llama, Mixtral) that compute
rtrainer's logits, and the way back (`--init-from`), through the functions and the `rtrainer` command."""
import json, random, subprocess, sys
import pytest, torch
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from rtrainer.cli import main
from rtrainer.distributed import write_dcp_checkpoint
from rtrainer.export import (checkpoint_kind, read_any_checkpoint, export_file, export_hf, read_hf_folder, quantize_int8,
                             dequantize_int8, quantize_weights, rtrainer_logits, hf_architecture, to_rotate_half, from_rotate_half)
from rtrainer.model import ModelConfig, TransformerLm, model_config, generate
from rtrainer.optimizer import AdamW
from rtrainer.tokenization import prepare_corpus, get_tokenizer
from rtrainer.training import (Trainer, TrainConfig, TrainingData, checkpoint_metadata, save_checkpoint, read_checkpoint, load_model,
                               seal_metadata)

RTRAINER = [sys.executable, "-m", "rtrainer"]
MOE = dict(shared_expert=False, moe_layers=(), moe_dispatch="dropless")     # what MixtralForCausalLM computes


def randomized(model, seed):
    "Every parameter drawn afresh (norms around 1), so that no swapped or transposed weight can hide behind ones or zeros."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            fresh = 1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name else 0.05 * torch.randn(p.shape, generator=g)
            p.copy_(fresh.to(p.dtype))
    return model


def trained(config, seed=0, steps=1):
    "(model, optimizer) after `steps` AdamW steps on random tokens: the moments are not zero."
    model = randomized(TransformerLm(config, device="cpu"), seed)
    opt = AdamW(model.named_parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (2, 17), generator=g)
        opt.zero_grad(); model(ids[:, :-1], ids[:, 1:])[0].backward(); opt.step()
    return model, opt


def save_dcp(folder, model, opt, step):
    "A distributed checkpoint as the distributed trainer writes it (state and step JSON), from one process."
    state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    state.update({f"optim.{k}": v for k, v in opt.state_tensors().items()})
    state["rng.torch_cpu"] = torch.get_rng_state()
    write_dcp_checkpoint(state, folder / f"step-{step:08d}", checkpoint_metadata(model.config, opt, step))
    return folder


def cli(*argv, capsys=None):
    status = main([str(a) for a in argv])
    return (status, capsys.readouterr()) if capsys else status


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    "A small prepared text corpus (r50k_base), with a held-out shard."
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(3)
    words = "the of a model weight token export layer expert rotary head norm scale file folder loss held out".split()
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(20, 80))) + "." for _ in range(400))
    (root / "text.txt").write_text(text)
    prepare_corpus("text", [str(root / "text.txt")], str(root / "data"), val_tokens=1500, progress=False)
    return root / "data"


def test_every_checkpoint_form_reads_and_exports_tensor_equal(tmp_path):
    model, opt = trained(model_config("tiny", vocab_size=512, impl="torch"))
    single = save_checkpoint(tmp_path / "run" / "checkpoints" / "step-00000005.safetensors", model, opt, 5)
    save_dcp((tmp_path / "dist").mkdir() or tmp_path / "dist", model, opt, 5)
    forms = {single: "file", tmp_path / "run" / "checkpoints": "file", tmp_path / "dist": "dcp",
             tmp_path / "dist" / "step-00000005.json": "dcp", tmp_path / "dist" / "step-00000005": "dcp"}
    source, _ = read_checkpoint(single)
    for path, kind in forms.items():
        assert checkpoint_kind(path) == kind, path
        tensors, meta = read_any_checkpoint(path)
        assert meta["step"] == 5
        for name, p in model.named_parameters(): assert torch.equal(tensors[f"model.{name}"], p.detach()), (path, name)
        out = export_file(path, tmp_path / f"out-{path.name}.safetensors")
        written = load_file(str(out))
        assert set(written) == {f"model.{n}" for n, _ in model.named_parameters()}                 # weights only
        assert all(torch.equal(written[k], source[k]) for k in written)
    gathered = export_file(tmp_path / "dist", tmp_path / "full.safetensors", with_optimizer=True)
    full, meta = read_checkpoint(gathered)
    moments = [k for k in source if k.startswith("optim.")]
    assert moments and all(torch.equal(full[k], source[k]) for k in moments) and meta["optimizer"]["step_count"] == 1
    resumed = Trainer(TrainConfig(data="synthetic", steps=6, batch_size=2, seq_len=16, resume=str(gathered), out_dir=str(tmp_path / "r"),
                                  progress=False, device="cpu"), model.config, log=lambda *a: None)      # --resume on one process
    assert resumed.step == 5 and resumed.optimizer.step_count == 1
    assert all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), model.parameters()))


def test_bf16_export_follows_the_precision_policy(tmp_path):
    model, opt = trained(model_config("tiny_moe", vocab_size=512, impl="torch"))
    out = export_file(save_checkpoint(tmp_path / "a.safetensors", model, opt, 1), tmp_path / "b.safetensors", dtype="bf16")
    w = load_file(str(out))
    assert w["model.blocks.1.moe.experts_gate_up"].dtype == w["model.lm_head"].dtype == torch.bfloat16
    assert w["model.blocks.1.moe.router"].dtype == w["model.final_norm"].dtype == torch.float32
    assert torch.equal(w["model.blocks.0.qkv"], model.blocks[0].qkv.detach().bfloat16())
    assert read_checkpoint(out)[1]["exported"]["dtype"] == "bf16"


@pytest.mark.parametrize("shape, axis", [((37, 53), -2), ((3, 29, 41), -2), ((61, 19), -1), ((1, 7), -2)])
def test_int8_rounds_each_channel_within_half_its_scale(shape, axis):
    w = torch.randn(shape) * torch.rand(shape[:-2] + (1, shape[-1])).add(0.01) * 5        # channels of unequal size
    q, scale = quantize_int8(w, axis)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape[axis] == 1
    assert q.abs().amax(axis).eq(127).all()                                               # each channel's largest weight is ±127
    reference = (w.double() / scale.double()).round().clamp(-127, 127)                   # float64 rounding of the same scale
    assert (q.double() - reference).abs().max() <= 1 and (q.double() != reference).float().mean() < 1e-3
    back = dequantize_int8(q, scale)
    assert ((back - w).abs() <= scale / 2 * (1 + 1e-5)).all()
    assert ((back.double() - w.double()).norm() / w.double().norm()).item() < 1e-2


def test_int8_export_is_smaller_and_only_int8_aware_readers_take_it(tmp_path):
    model, opt = trained(model_config("tiny", impl="torch"))
    ckpt = save_checkpoint(tmp_path / "a.safetensors", model, opt, 3)
    fp32 = export_file(ckpt, tmp_path / "fp32.safetensors")
    int8 = export_file(ckpt, tmp_path / "int8.safetensors", quantize="int8")
    assert int8.stat().st_size < 0.3 * fp32.stat().st_size
    with safe_open(str(int8), framework="pt") as f:                                    # the file as stored, not dequantized
        raw, meta = {k: f.get_tensor(k) for k in f.keys()}, json.loads(f.metadata()["rtrainer"])
    assert meta["weights"]["quantization"] == "int8-per-output-channel"
    assert raw["model.embedding.int8"].dtype == torch.int8 and raw["model.embedding.scale"].shape == (model.config.vocab_size, 1)
    assert raw["model.lm_head.scale"].shape == (1, model.config.padded_vocab_size)
    assert "model.embedding" not in raw and torch.equal(raw["model.final_norm"], model.final_norm.detach())   # norms kept as they were
    with pytest.raises(ValueError, match="quantized"): load_model(int8, device="cpu")     # never integers loaded as weights
    back, _ = read_any_checkpoint(int8)
    for name, p in model.named_parameters():
        rel = ((back[f"model.{name}"] - p.detach()).norm() / p.detach().norm()).item()
        assert rel == 0 if "norm" in name else rel < 1e-2, (name, rel)
    tensors, _ = quantize_weights({f"model.{n}": p.detach() for n, p in model.named_parameters()})
    save_file(tensors, str(tmp_path / "int4.safetensors"), metadata={"rtrainer": json.dumps(seal_metadata(dict(meta, weights=dict(quantization="int4")), tensors))})
    with pytest.raises(ValueError, match="quantized as"): read_any_checkpoint(tmp_path / "int4.safetensors")   # a scheme it does not know


def test_eval_and_generate_read_every_form(tmp_path, corpus, capsys):
    model, opt = trained(model_config("tiny", impl="torch"), seed=4)
    single = save_checkpoint(tmp_path / "one.safetensors", model, opt, 2)
    save_dcp((tmp_path / "dist").mkdir() or tmp_path / "dist", model, opt, 2)
    assert cli("export", single, tmp_path / "int8.safetensors", "--quantize", "int8") == 0
    assert cli("export", tmp_path / "dist", tmp_path / "hf", "--format", "hf") == 0
    assert cli("export", tmp_path / "dist", tmp_path / "bf16.safetensors", "--dtype", "bf16") == 0
    capsys.readouterr()
    losses, texts = {}, {}
    for name in ("one.safetensors", "dist", "hf", "bf16.safetensors", "int8.safetensors"):
        status, out = cli("eval", "--checkpoint", tmp_path / name, "--data", corpus, "--max-batches", 3, "--device", "cpu", capsys=capsys)
        assert status == 0, out.err
        losses[name] = float(out.out.split("held-out loss ")[1].split(",")[0])
        status, out = cli("generate", "--checkpoint", tmp_path / name, "--prompt", "The model", "--max-new-tokens", 12,
                          "--temperature", 0, "--device", "cpu", capsys=capsys)
        assert status == 0, out.err
        texts[name] = out.out
    print(losses)
    assert losses["dist"] == losses["one.safetensors"] and texts["dist"] == texts["one.safetensors"]
    assert abs(losses["hf"] - losses["one.safetensors"]) < 1e-4 and texts["hf"] == texts["one.safetensors"]
    for name in ("bf16.safetensors", "int8.safetensors"): assert abs(losses[name] - losses["one.safetensors"]) < 0.05, name


def greedy_hf(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset, overrides, architecture", [("tiny", {}, "LlamaForCausalLM"), ("tiny_moe", MOE, "MixtralForCausalLM"),
                                                              ("tiny", dict(tie_embeddings=True), "LlamaForCausalLM")])
def test_transformers_computes_rtrainers_logits_and_tokens(tmp_path, preset, overrides, architecture):
    from transformers import AutoModelForCausalLM
    config = model_config(preset, impl="torch", **overrides)
    model, opt = trained(config, seed=7)
    folder = export_hf(save_checkpoint(tmp_path / "a.safetensors", model, opt, 1), tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [architecture] and cfg["vocab_size"] == 50257
    assert cfg["tie_word_embeddings"] is config.tie_embeddings
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (64, 4, 2, 16)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture and hf.lm_head.weight.shape == (50257, 64)
    ids = torch.randint(0, config.vocab_size, (3, 41), generator=torch.Generator().manual_seed(11))
    with torch.no_grad(): theirs = hf(ids).logits
    ours = rtrainer_logits(model, ids)
    err = ((theirs.double() - ours.double()).norm() / ours.double().norm()).item()
    print(f"{architecture}: relative logit error {err:.2e}, largest difference {(theirs - ours).abs().max().item():.2e}")
    assert err < 1e-5 and torch.allclose(theirs, ours, rtol=1e-4, atol=1e-5)
    tok = get_tokenizer()
    for prompt in ("The export", "def f(x):\n    return", "Mixture of experts"):
        ids = tok.encode_ordinary(prompt)
        assert greedy_hf(hf, ids, 12) == generate(model, ids, 12, temperature=0), prompt


def test_a_wrong_rotary_layout_would_be_caught(tmp_path):
    "The logits test fails without the q/k permutation: the test above checks the permutation, not just the names."
    from transformers import AutoModelForCausalLM
    config = model_config("tiny", impl="torch")
    model, opt = trained(config, seed=2)
    folder = export_hf(save_checkpoint(tmp_path / "a.safetensors", model, opt, 1), tmp_path / "hf")
    w = load_file(str(folder / "model.safetensors"))
    for k in [k for k in w if k.endswith(("q_proj.weight", "k_proj.weight"))]:
        heads = config.n_heads if "q_proj" in k else config.n_kv_heads
        w[k] = from_rotate_half(w[k], heads, config.head_dim).contiguous()                  # back to interleaved pairs
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (1, 31), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(): assert not torch.allclose(hf(ids).logits, rtrainer_logits(model, ids), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("preset, overrides", [("tiny", {}), ("tiny_moe", MOE), ("tiny", dict(precision="bf16")), ("tiny", dict(tie_embeddings=True)),
                                               ("tiny_moe", dict(MOE, moe_dispatch="capacity", capacity_factor=1.25))])
def test_round_trip_through_transformers_is_exact(tmp_path, preset, overrides):
    from transformers import AutoModelForCausalLM
    model, opt = trained(model_config(preset, impl="torch", **overrides), seed=9)
    source = save_checkpoint(tmp_path / "a.safetensors", model, opt, 4)
    folder = export_hf(source, tmp_path / "hf")
    resaved = tmp_path / "resaved"                                      # transformers' own save, in its own names
    AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).save_pretrained(resaved)   # fp32: no rounding of its own
    original, meta = read_checkpoint(source)
    V = model.config.vocab_size
    for path in (folder, resaved):
        back, back_meta = read_hf_folder(path)
        assert back_meta["step"] == 4
        assert back.keys() == {k for k in original if k.startswith("model.")}
        tied = model.config.tie_embeddings             # the tied table is (VP, D): its padding rows come back zero
        for k, v in back.items():
            want = original[k][:, :V] if k == "model.lm_head" else original[k][:V] if tied and k == "model.embedding" else original[k]
            got = v[:, :V] if k == "model.lm_head" else v[:V] if tied and k == "model.embedding" else v
            if path == resaved: got = got.to(want.dtype)            # transformers keeps every tensor in one dtype (fp32 here)
            assert got.dtype == want.dtype and torch.equal(got, want), (path.name, k)
        padding = back["model.embedding"][V:] if tied else back["model.lm_head"][:, V:]
        assert not padding.any()                                          # the padding, which no logit reads, comes back zero
    assert ModelConfig.from_dict(read_hf_folder(folder)[1]["model_config"]) == ModelConfig.from_dict(meta["model_config"])


def test_round_trip_weights_in_rotate_half_order():
    w = torch.randn(5 * 12, 7)
    assert torch.equal(from_rotate_half(to_rotate_half(w, 5, 12), 5, 12), w)
    assert to_rotate_half(torch.arange(8.)[:, None], 1, 8).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


def test_transformers_tokenizer_encodes_like_tiktoken(tmp_path):
    from transformers import AutoTokenizer
    model, opt = trained(model_config("tiny", impl="torch", n_layers=1))
    folder = export_hf(save_checkpoint(tmp_path / "a.safetensors", model, opt, 1), tmp_path / "hf")
    hf_tok, tok = AutoTokenizer.from_pretrained(folder), get_tokenizer()
    rng = random.Random()                                                 # fresh text every run
    pieces = ["the", " The", "'s", "'ll", " don't", "  ", "\n", "\n\n", "\t", "123", " 4567", "3.14", "über", " naïve", "日本語",
              "😀", "def", "(x)", "**", " #", "—", "Ġ", "ĊĠ", "    return", "http://example.invalid/a?b=c", "ÿ", "\u00a0", "a\r\nb"]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(5, 60)))
        assert hf_tok(text)["input_ids"] == tok.encode_ordinary(text), repr(text)
        assert hf_tok.decode(tok.encode_ordinary(text)) == text
    assert hf_tok("a<|endoftext|>b")["input_ids"] == tok.encode("a<|endoftext|>b", allowed_special="all")


def test_what_transformers_does_not_compute_is_refused_in_one_line(tmp_path, capsys):
    for overrides, why in [({}, "shared expert"), (dict(shared_expert=False), "dense among MoE")]:
        with pytest.raises(ValueError, match=why): hf_architecture(model_config("tiny_moe", **overrides))
        model, opt = trained(model_config("tiny_moe", vocab_size=512, impl="torch", **overrides))
        ckpt = save_checkpoint(tmp_path / f"m{len(overrides)}.safetensors", model, opt, 1)
        if overrides:
            status, out = cli("export", ckpt, tmp_path / "out", "--format", "hf", capsys=capsys)
            status, err = status, out.err
        else:                                                            # once as a user runs it: exit status and stderr
            r = subprocess.run([*RTRAINER, "export", str(ckpt), str(tmp_path / "out"), "--format", "hf"], capture_output=True, text=True, timeout=300)
            status, err = r.returncode, r.stderr
        assert status == 2 and why in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_export_command_errors(tmp_path, capsys):
    model, opt = trained(model_config("tiny", vocab_size=512, impl="torch"))
    ckpt = save_checkpoint(tmp_path / "a.safetensors", model, opt, 1)
    for argv, why in [(("export", tmp_path / "none", tmp_path / "b"), "no such checkpoint"),
                      (("export", ckpt, tmp_path / "h", "--format", "hf", "--quantize", "int8"), "no --quantize"),
                      (("export", ckpt, tmp_path / "c", "--with-optimizer", "--dtype", "bf16"), "no --dtype"),
                      (("export", ckpt, ckpt), "its own source"),
                      (("export", ckpt, tmp_path / "a.safetensors"), "its own source")]:
        status, out = cli(*argv, capsys=capsys)
        assert status == 2 and why in out.err and len(out.err.strip().splitlines()) == 1, (argv, out.err)
    assert cli("export", ckpt, tmp_path / "b.safetensors") == 0
    status, out = cli("export", ckpt, tmp_path / "b.safetensors", capsys=capsys)
    assert status == 2 and "--force" in out.err
    assert cli("export", ckpt, tmp_path / "b.safetensors", "--force") == 0
    (tmp_path / "notes").mkdir(); (tmp_path / "notes" / "keep.txt").write_text("mine")
    status, out = cli("export", ckpt, tmp_path / "notes", "--format", "hf", "--force", capsys=capsys)
    assert status == 2 and "not a transformers folder" in out.err and (tmp_path / "notes" / "keep.txt").exists()


def test_reading_a_folder_transformers_wrote_but_rtrainer_does_not_compute(tmp_path):
    model, opt = trained(model_config("tiny", vocab_size=512, impl="torch"))
    folder = export_hf(save_checkpoint(tmp_path / "a.safetensors", model, opt, 1), tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    for change, why in [(dict(rope_scaling=dict(rope_type="linear", factor=2.0)), "rope_scaling"), (dict(attention_bias=True), "attention_bias"),
                        (dict(architectures=["GPT2LMHeadModel"]), "architecture")]:
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=why): read_hf_folder(folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"): read_hf_folder(folder)


def test_init_from_a_transformers_folder_or_an_int8_export(tmp_path, capsys):
    config = model_config("tiny", vocab_size=512, impl="torch")
    model, opt = trained(config, seed=5)
    ckpt = save_checkpoint(tmp_path / "a.safetensors", model, opt, 1)
    assert cli("export", ckpt, tmp_path / "hf", "--format", "hf") == 0
    assert cli("export", ckpt, tmp_path / "int8.safetensors", "--quantize", "int8") == 0
    inputs, targets = TrainingData("synthetic", 0, 512).batch(0, 2, 16)
    with torch.no_grad(): first_loss = model(inputs, targets)[1].item()     # the run's first loss, before its first update
    capsys.readouterr()
    common = ["train", "tiny", "--vocab-size", 512, "--data", "synthetic", "--steps", 1, "--batch-size", 2, "--seq-len", 16,
              "--log-every", 1, "--eval-every", 0, "--device", "cpu", "--no-progress", "--impl", "torch"]
    for source, tolerance in (("hf", 1e-5), ("int8.safetensors", 2e-2)):
        out_dir = tmp_path / f"run-{source}"
        status, out = cli(*common, "--init-from", tmp_path / source, "--out-dir", out_dir, capsys=capsys)
        assert status == 0, out.err
        converted = out_dir / "init-from" / "model.safetensors"
        assert f"initialized from {converted}" in out.out
        row = [json.loads(l) for l in (out_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in l][0]
        assert abs(row["loss"] - first_loss) < tolerance, (source, row["loss"], first_loss)
        if source == "hf":
            weights = load_file(str(converted))
            for name, p in model.named_parameters():
                want = p.detach()[:, :config.vocab_size] if name == "lm_head" else p.detach()
                got = weights[f"model.{name}"][:, :config.vocab_size] if name == "lm_head" else weights[f"model.{name}"]
                assert torch.equal(got, want), name
    status, out = cli(*common, "--init-from", tmp_path / "hf", "--init-moments", "--out-dir", tmp_path / "m", capsys=capsys)
    assert status == 2 and "no optimizer moments" in out.err
