"Training chapter: checkpoints, resume, init-from, non-finite stops, SFT, and the commands' errors."
import json, hashlib, os, re, subprocess, sys
from pathlib import Path
import pytest, torch
from rtrainer import training
from rtrainer.cli import main
from rtrainer.model import model_config
from rtrainer.tokenization import prepare_corpus
from rtrainer.training import (Trainer, TrainConfig, NonFiniteLoss, save_checkpoint, read_checkpoint, load_model_weights)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "docs"
    prepare_corpus("python-docs", [], str(out), progress=False)
    return str(out)


def cfg(tmp_path, **kw):
    base = dict(data="synthetic", steps=4, batch_size=2, seq_len=16, warmup=1, eval_every=0, out_dir=str(tmp_path / "run"),
                progress=False, device="cpu")
    return TrainConfig(**{**base, **kw})


def quiet(*a): pass


def test_checkpoint_round_trip_is_exact(tmp_path):
    t = Trainer(cfg(tmp_path, steps=2), model_config("tiny"), log=quiet); t.run()
    path = tmp_path / "a.safetensors"
    save_checkpoint(path, t.model, t.optimizer, t.step, t.cfg)
    tensors, meta = read_checkpoint(path)
    u = Trainer(cfg(tmp_path, steps=2), model_config("tiny"), log=quiet)
    with torch.no_grad():
        for p in u.model.parameters(): p.add_(1.0)          # make sure the load is what restores them
    load_model_weights(u.model, tensors)
    u.optimizer.load_state_tensors({k[6:]: v for k, v in tensors.items() if k.startswith("optim.")}, meta["optimizer"]["step_count"])
    path2 = tmp_path / "b.safetensors"
    save_checkpoint(path2, u.model, u.optimizer, meta["step"], t.cfg)
    tensors2, meta2 = read_checkpoint(path2)
    assert tensors.keys() == tensors2.keys()
    for k in tensors:
        if k != "rng.torch_cpu": assert torch.equal(tensors[k], tensors2[k]), k
    assert meta2["model_config"] == meta["model_config"] and meta2["step"] == meta["step"] == 2
    assert all(k in meta for k in ["optimizer", "train", "data", "rtrainer_version", "commit"])



def test_one_helper_makes_the_metadata_of_every_checkpoint(tmp_path):
    "save_checkpoint writes what training.checkpoint_metadata makes, `extra` included; the sharded trainer uses the same one."
    from rtrainer import distributed
    t = Trainer(cfg(tmp_path, steps=1), model_config("tiny"), log=quiet); t.run()
    extra = dict(data=dict(seed=7, next_step=9), run_id="r1")
    _, meta = read_checkpoint(save_checkpoint(tmp_path / "a.safetensors", t.model, t.optimizer, t.step, t.cfg, extra=extra))
    made = json.loads(json.dumps(training.checkpoint_metadata(t.model.config, t.optimizer, t.step, t.cfg, extra), default=list))
    assert {k: v for k, v in meta.items() if k != "checksums"} == made and made["data"] == extra["data"] and made["step"] == 1
    assert distributed.checkpoint_metadata is training.checkpoint_metadata

def test_resume_is_bit_exact_with_accumulation(tmp_path):
    def run(steps, out, resume=""):
        t = Trainer(cfg(tmp_path, steps=steps, decay_steps=6, accumulation=2, out_dir=str(tmp_path / out), resume=resume),
                    model_config("tiny"), log=quiet)
        t.run(); return t
    straight, _ = run(6, "s"), run(3, "h")
    resumed = run(6, "h", resume=str(tmp_path / "h" / "checkpoints"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()): assert torch.equal(a, b)
    assert resumed.optimizer.step_count == 6


def test_skip_batches_moves_the_data_position_and_keeps_it(tmp_path):
    "A resume past N steps' batches reads what a run reads N steps later; its checkpoints, and a later resume, keep the offset."
    def trainer(steps, out, **kw):
        t = Trainer(cfg(tmp_path, steps=steps, decay_steps=10, accumulation=2, out_dir=str(tmp_path / out), **kw), model_config("tiny"), log=quiet)
        seen, batch = [], t.data.batch
        t.data.batch = lambda step, *a, **k: (seen.append((step, batch(step, *a, **k))), seen[-1][1])[1]
        return t, seen
    reference, _ = trainer(10, "reference")
    first, _ = trainer(3, "first"); first.run()
    skipped, seen = trainer(5, "skipped", resume=str(tmp_path / "first" / "checkpoints"), skip_batches=2); skipped.run()
    assert [s for s, _ in seen] == [5, 6]                              # steps 3 and 4 read the batches of steps 5 and 6
    for step, (_, (inputs, targets)) in zip((3, 4), seen):
        want, want_targets, _ = reference.host_batches(step + 2)
        assert torch.equal(inputs, want) and torch.equal(targets, want_targets)
    _, meta = read_checkpoint(tmp_path / "skipped" / "checkpoints")
    assert meta["step"] == 5 and meta["data"] == dict(seed=0, next_step=7, batch_offset=2)
    again, seen = trainer(7, "skipped", resume=str(tmp_path / "skipped" / "checkpoints")); again.run()
    assert [s for s, _ in seen] == [7, 8]                              # the second resume keeps the offset
    _, meta = read_checkpoint(tmp_path / "skipped" / "checkpoints")
    assert meta["step"] == 7 and meta["data"] == dict(seed=0, next_step=9, batch_offset=2)
    more, seen = trainer(8, "skipped", resume=str(tmp_path / "skipped" / "checkpoints"), skip_batches=1); more.run()
    assert [s for s, _ in seen] == [10] and read_checkpoint(tmp_path / "skipped" / "checkpoints")[1]["data"]["batch_offset"] == 3


def test_tensorboard_scalars_are_the_metrics(tmp_path, corpus):
    "--tensorboard: every number of metrics.jsonl, and nothing else, is a scalar at its step in OUT_DIR/tensorboard/."
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    t = Trainer(cfg(tmp_path, data=corpus, steps=4, log_every=1, eval_every=2, eval_batches=2, tensorboard=True), model_config("tiny"), log=quiet)
    t.peak_tflops = 1e-6        # a made-up peak, so that the CPU run logs an MFU too
    t.run()
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")); events.Reload()
    numbers = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, (int, float))}
    assert set(events.Tags()["scalars"]) == numbers >= {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"}
    for tag in numbers:
        logged = [(r["step"], r[tag]) for r in rows if tag in r]
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [(s, pytest.approx(v, rel=1e-6)) for s, v in logged], tag


def test_tensorboard_without_the_package_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)           # as if it were not installed
    assert cli("train", "--tensorboard", "--data", "synthetic", "--steps", "1", "--out-dir", tmp_path / "o", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tensorboard needs the tensorboard package" in err and not (tmp_path / "o").exists()


def test_init_checkpoints_are_the_same_bytes_and_train_as_the_seed(tmp_path, capsys):
    "`rtrainer init`: two calls (two processes) write the same bytes, no moments; --resume and --init-from train as the seed does."
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert cli("init", "tiny", "--out", a, "--seed", "3", "--device", "cpu") == 0
    assert f"rtrainer train tiny --resume {a} --seed 3" in capsys.readouterr().out
    r = subprocess.run([sys.executable, "-m", "rtrainer", "init", "tiny", "--out", str(b), "--seed", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert a.read_bytes() == b.read_bytes()
    tensors, meta = read_checkpoint(a)
    assert meta["step"] == 0 and meta["optimizer"]["step_count"] == 0 and not any(k.startswith("optim.") for k in tensors)
    assert meta["train"] == {"seed": 3} and meta["data"] == dict(seed=3, next_step=0, batch_offset=0) and "run_id" not in meta
    def run(out, **kw):
        t = Trainer(cfg(tmp_path, steps=3, out_dir=str(tmp_path / out), **{"seed": 3, **kw}), model_config("tiny"), log=quiet); t.run(); return t
    fresh, resumed, initialized = run("fresh"), run("resumed", resume=str(a)), run("initialized", init_from=str(a))
    for other in (resumed, initialized):
        for (n, p), q in zip(fresh.model.named_parameters(), other.model.parameters()): assert torch.equal(p, q), n
        for k, v in fresh.optimizer.state_tensors().items(): assert torch.equal(v, other.optimizer.state_tensors()[k]), k
    with pytest.raises(ValueError, match="--seed 4 .checkpoint 3."): run("other-seed", resume=str(a), seed=4)
    assert cli("init", "tiny", "--out", a, "--device", "cpu") == 2 and "exists already" in capsys.readouterr().err
    assert cli("init", "tiny", "--out", tmp_path / "c.safetensors", "--seed", "-1") == 2
    assert "--seed must be an integer >= 0" in capsys.readouterr().err and not (tmp_path / "c.safetensors").exists()


@pytest.mark.parametrize("impl, preset", [("torch", "tiny"), ("torch", "tiny_moe"), ("triton", "tiny"), ("triton", "tiny_moe")])
def test_activation_checkpointing_gives_the_plain_gradients(tmp_path, impl, preset):
    "selective and full rerun the forward in the backward; a step of two micro-batches writes each fp32 gradient as without."
    from rtrainer.kernels import gradient_fp32
    grads, runs = {}, {}
    for mode in ("none", "selective", "full"):
        t = Trainer(cfg(tmp_path / mode, accumulation=2, activation_checkpointing=mode), model_config(preset, impl=impl, vocab_size=512), log=quiet)
        assert t.model.impl == impl
        forward, runs[mode] = t.model._attention, []
        t.model._attention = lambda blk, x: (runs[mode].append(t.model.replaying), forward(blk, x))[1]
        stats, norm, _ = t.accumulate(t.micro_batches(0), 0.01)
        grads[mode] = {n: gradient_fp32(p).clone() for n, p in t.model.named_parameters()}
        assert len(t.model.moe_stats) == sum(blk.moe is not None for blk in t.model.blocks)   # once, not again by the rerun
    layers = model_config(preset).n_layers
    assert runs["none"] == [False] * 2 * layers                    # two micro-batches, each attention run once
    assert runs["selective"] == runs["full"] == ([False] * layers + [True] * layers) * 2   # then again in each backward
    for mode in ("selective", "full"):
        for name, g in grads["none"].items():
            assert ((grads[mode][name] - g).norm() / g.norm()).item() < 1e-6, (mode, name)


def test_activation_checkpointing_and_the_cuda_graph(tmp_path, capsys):
    assert cli("train", "--activation-checkpointing", "full", "--cuda-graph", "--data", "synthetic", "--out-dir", tmp_path / "o", "--no-progress") == 2
    assert "--cuda-graph and --activation-checkpointing full do not go together" in capsys.readouterr().err and not (tmp_path / "o").exists()
    t = Trainer(cfg(tmp_path, activation_checkpointing="selective"), model_config("tiny"), log=quiet)
    with pytest.raises(ValueError, match="does not capture"): training.CapturedStep(t, capture=False)   # so --cuda-graph auto takes eager steps


def test_memory_budget_halves_the_micro_batch_and_keeps_the_global_batch():
    from rtrainer.training import fit_micro_batch
    GiB, probes = 2**30, []
    def peak(B, accumulation): probes.append((B, accumulation)); return None if B > 8 else 4 * GiB + B * GiB   # None: out of memory
    assert fit_micro_batch(32, 2, 10 * GiB, peak) == (4, 16, 8 * GiB) and probes == [(32, 2), (16, 4), (8, 8), (4, 16)]
    probes.clear(); assert fit_micro_batch(12, 1, 6 * GiB, peak) == (1, 12, 5 * GiB) and probes == [(12, 1), (6, 2), (3, 4), (1, 12)]
    probes.clear(); assert fit_micro_batch(7, 1, 5 * GiB, peak) == (1, 7, 5 * GiB) and probes == [(7, 1), (1, 7)]   # 3 does not divide 7
    probes.clear(); assert fit_micro_batch(8, 3, 12 * GiB, peak) == (8, 3, 12 * GiB) and probes == [(8, 3)]       # as asked if it fits
    with pytest.raises(ValueError, match=r"--memory-budget 2 GiB: no micro-batch fits .*8: 12.0 GiB, 4: 8.0 GiB, 2: 6.0 GiB, 1: 5.0 GiB"):
        fit_micro_batch(8, 1, 2 * GiB, peak)


def test_a_fitted_split_trains_as_the_asked_one(tmp_path):
    "The split the budget picks (moments made before the first step) trains on the same sequences as the split asked for."
    def trainer(out, **kw):
        return Trainer(cfg(tmp_path, steps=3, out_dir=str(tmp_path / out), **{"batch_size": 4, "accumulation": 1, **kw}), model_config("tiny"), log=quiet)
    fitted, asked = trainer("fitted"), trainer("asked", batch_size=2, accumulation=2)
    fitted.cfg.memory_budget = 1.0       # the probe is a GPU's; here a stand-in says only micro-batches of 2 fit
    fitted.probe_peak = lambda B, accumulation: 2**29 if B <= 2 else None
    fitted.fit_memory_budget()
    assert (fitted.cfg.batch_size, fitted.cfg.accumulation) == (2, 2) and len(fitted.optimizer.state_tensors()) == 2 * len(fitted.optimizer.params)
    fitted.run(); asked.run()
    for a, b in zip(fitted.model.parameters(), asked.model.parameters()): assert torch.equal(a, b)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    t = Trainer(cfg(tmp_path, steps=1), model_config("tiny"), log=quiet); t.run()
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, t.model, t.optimizer, 1, t.cfg)
    before = path.read_bytes()
    def crash(*a, **k): raise OSError("simulated crash before rename")
    monkeypatch.setattr(training.os, "replace", crash)
    with torch.no_grad(): next(t.model.parameters()).add_(1.0)
    with pytest.raises(FileExistsError, match="never rewrites"): save_checkpoint(path, t.model, t.optimizer, 2, t.cfg)
    with pytest.raises(OSError, match="simulated"): save_checkpoint(path, t.model, t.optimizer, 2, t.cfg, overwrite=True)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    _, meta = read_checkpoint(path); assert meta["step"] == 1


def test_non_finite_loss_stops_before_the_step(tmp_path):
    t = Trainer(cfg(tmp_path, steps=6, checkpoint_every=2), model_config("tiny"), log=quiet)
    real = t.model.forward
    after_step_3 = {}
    def poisoned(ids, targets, mask=None, load_balance_weight=0.0):
        loss, lm, lb = real(ids, targets, mask, load_balance_weight)
        if t.step == 3:
            after_step_3.update({n: p.detach().clone() for n, p in t.model.named_parameters()})
            after_step_3.update({n: m.clone() for n, m in t.optimizer.state_tensors().items()})
            loss = loss * float("nan"); lm = lm * float("nan")
        return loss, lm, lb
    t.model.forward = poisoned
    with pytest.raises(NonFiniteLoss, match="step 4"): t.run()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-00000002.safetensors"]
    assert t.optimizer.step_count == 3
    # the host learns of step 4 one step late, but the device skipped its update: weights and moments are step 3's
    now = {**dict(t.model.named_parameters()), **t.optimizer.state_tensors()}
    assert after_step_3.keys() == now.keys() and all(torch.equal(after_step_3[k], now[k]) for k in now)


def test_keep_last_k_and_outputs(tmp_path, corpus):
    t = Trainer(cfg(tmp_path, data=corpus, steps=5, checkpoint_every=1, keep=2, eval_every=5, eval_batches=2, log_every=1),
                model_config("tiny"), log=quiet)
    t.run()
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert names == ["step-00000004.safetensors", "step-00000005.safetensors"]
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert all(k in next(r for r in rows if "loss" in r) for k in ["lr", "loss", "grad_norm", "tokens_per_s"])
    assert rows[0]["step"] == 0 and rows[0]["val_loss"] > 10  # the untrained model, evaluated before step 1
    ev = [r for r in rows if "val_loss" in r][-1]
    assert ev["val_ppl"] > 1 and isinstance(ev["sample"], str)
    assert (tmp_path / "run" / "loss_curve.png").stat().st_size > 1000


def test_init_from_reads_and_never_writes(tmp_path):
    Trainer(cfg(tmp_path, steps=2, out_dir=str(tmp_path / "a")), model_config("tiny"), log=quiet).run()
    src = tmp_path / "a" / "checkpoints" / "step-00000002.safetensors"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    t = Trainer(cfg(tmp_path, steps=3, out_dir=str(tmp_path / "b"), init_from=str(src)), model_config("tiny"), log=quiet)
    assert t.step == 0 and t.optimizer.step_count == 0
    t.run()
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    with pytest.raises(ValueError, match="inside this run's checkpoint folder"):
        Trainer(cfg(tmp_path, out_dir=str(tmp_path / "a"), init_from=str(src)), model_config("tiny"), log=quiet)
    u = Trainer(cfg(tmp_path, steps=3, out_dir=str(tmp_path / "c"), init_from=str(src), init_moments=True), model_config("tiny"), log=quiet)
    assert u.optimizer.step_count == 2


def test_shape_mismatch_is_refused_naming_fields(tmp_path):
    Trainer(cfg(tmp_path, steps=1), model_config("tiny"), log=quiet).run()
    with pytest.raises(ValueError, match=r"d_model \(checkpoint 64, config 96\)"):
        Trainer(cfg(tmp_path, steps=2, resume=str(tmp_path / "run" / "checkpoints")), model_config("tiny", d_model=96), log=quiet)


def test_sft_trains_on_responses(tmp_path):
    f = tmp_path / "sft.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": f"Q: what is {i} plus {i}?\nA: ", "response": f"{2 * i}."}) for i in range(20)))
    t = Trainer(cfg(tmp_path, steps=3, sft=str(f), batch_size=4), model_config("tiny"), log=quiet)
    inputs, targets, mask = next(t.micro_batches(0))
    assert mask.any() and not mask.all()
    t.run()
    assert all(r["loss"] == r["loss"] for r in t.history if "loss" in r)


def cli(*args):
    return main([str(a) for a in args])


def test_cli_errors(tmp_path, capsys):
    assert cli("train", "--data", tmp_path / "nothing", "--out-dir", tmp_path / "o", "--no-progress") == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert cli("train", "--data", "synthetic", "--resume", "x", "--init-from", "y", "--no-progress") == 2
    assert "exclusive" in capsys.readouterr().err
    for flag in ("--resume", "--init-from", "--sft"):     # refused before the bundled corpus would be prepared
        assert cli("train", flag, tmp_path / "missing", "--out-dir", tmp_path / "o", "--no-progress") == 2
        assert f"{flag} {tmp_path / 'missing'}: no such file or folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert cli("train", "--steps", "0", "--data", "synthetic", "--no-progress") == 2
    assert "--steps must be positive" in capsys.readouterr().err
    assert cli("train", "nonexistent-preset", "--data", "synthetic", "--no-progress") == 2
    assert "unknown model config" in capsys.readouterr().err
    assert cli("eval", "--checkpoint", tmp_path / "none.safetensors", "--data", tmp_path) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_a_cpu_run_too_large_for_the_host_is_refused(tmp_path, capsys, monkeypatch):
    B, T, V = 3, 40, 512                                      # the floor: 2 fp32 (B*T, V) tensors, logits and log-softmax
    floor = 2 * B * T * V * 4
    monkeypatch.setattr(training, "host_memory_free", lambda: floor - 1)
    with pytest.raises(ValueError, match=r"--batch-size 3 x --seq-len 40: .* need 0\.0 GiB"):
        Trainer(cfg(tmp_path, batch_size=B, seq_len=T), model_config("tiny", vocab_size=V), log=quiet)
    assert cli("train", "tiny", "--data", "synthetic", "--batch-size", B, "--seq-len", T, "--vocab-size", V,
               "--out-dir", tmp_path / "o", "--no-progress") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lower --batch-size or --seq-len" in err and not (tmp_path / "o").exists()
    for free in (floor, None):                                # enough, or unknown (no /proc/meminfo): the run goes ahead
        monkeypatch.setattr(training, "host_memory_free", lambda free=free: free)
        Trainer(cfg(tmp_path, batch_size=B, seq_len=T), model_config("tiny", vocab_size=V), log=quiet)
    free = training.host_memory_free()                        # this machine's own answer: a positive byte count, or None
    assert free is None or free > 0


def test_default_learning_rate_follows_the_model(tmp_path, capsys):
    "--lr left at 0 takes the tiny presets' 3e-3 or the reference configurations' 3e-4; a given rate is kept; a negative one is refused."
    assert TrainConfig().validate().lr == 3e-3 and TrainConfig(model="tiny_moe").validate().lr == 3e-3
    for name in ("rb100m", "prof183m", "dense1b", "moe4b", "configs/mine.json"):
        assert TrainConfig(model=name).validate().lr == 3e-4
    assert TrainConfig(model="moe4b", lr=1e-3).validate().lr == 1e-3
    with pytest.raises(ValueError, match="--lr must be positive"): TrainConfig(lr=-1e-3).validate()
    assert cli("train", "--data", "synthetic", "--lr", "-1", "--no-progress", "--out-dir", tmp_path / "o") == 2
    assert "--lr must be positive" in capsys.readouterr().err


def test_evaluation_before_the_first_logged_row(tmp_path):
    "An evaluation step before any metrics row (synthetic data: no held-out part) neither crashes nor plots an empty curve."
    t = Trainer(cfg(tmp_path, steps=4, eval_every=2, log_every=10, checkpoints=False), model_config("tiny", impl="torch"), log=quiet)
    t.run()
    assert (tmp_path / "run" / "loss_curve.png").exists() and len([r for r in t.history if "loss" in r]) == 1


def test_moe_table_shows_capacity_drops(tmp_path, capsys):
    "Under capacity dispatch the logged table gains a column of the step's dropped assignments (in percent); dropless has none."
    for dispatch in ("capacity", "dropless"):
        lines = []
        Trainer(cfg(tmp_path / dispatch, steps=2, eval_every=2), model_config("tiny_moe", impl="torch", moe_dispatch=dispatch), log=lines.append).run()
        table = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["2"]]
        header = next(line for line in lines if line.split()[:1] == ["step"])
        assert (header.split()[-1] == "dropped") == (dispatch == "capacity"), header
        assert len(table) == 1 and table[0].endswith("%") == (dispatch == "capacity"), table
        if dispatch == "capacity": assert 0 <= float(table[0].split()[-1].rstrip("%")) <= 100


def test_cli_train_eval_generate(tmp_path, corpus, capsys):
    out = tmp_path / "cli"
    assert cli("train", "--data", corpus, "--steps", 3, "--batch-size", 2, "--seq-len", 16, "--eval-every", 3,
               "--eval-batches", 1, "--out-dir", out, "--device", "cpu", "--no-progress") == 0
    text = capsys.readouterr().out
    assert "held-out" in text and "checkpoint:" in text
    assert cli("eval", "--checkpoint", out / "checkpoints", "--data", corpus, "--max-batches", 2, "--device", "cpu") == 0
    assert "perplexity" in capsys.readouterr().out
    assert cli("generate", "--checkpoint", out / "checkpoints", "--prompt", "The", "--max-new-tokens", 5, "--device", "cpu") == 0
    assert capsys.readouterr().out.startswith("The")


def test_cli_non_finite_exits_non_zero(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import sys; from rtrainer.cli import main; sys.exit(main())", "train",
                        "--data", "synthetic", "--steps", "6", "--lr", "1e30", "--warmup", "0", "--clip", "0",
                        "--batch-size", "2", "--seq-len", "16", "--out-dir", str(tmp_path / "nan"), "--no-progress", "--device", "cpu"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "non-finite" in r.stderr and "step" in r.stderr

def test_synthetic_batches_are_contiguous_and_shifted():
    "The trainer pins batches for an asynchronous copy; a strided batch would be staged through pageable memory."
    data = training.TrainingData("synthetic", seed=3, vocab_size=101)
    inputs, targets = data.batch(5, 4, 9)
    assert inputs.is_contiguous() and targets.is_contiguous() and inputs.shape == targets.shape == (4, 9)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])

def test_shards_with_a_larger_vocabulary_than_the_model_are_refused(tmp_path):
    "r50k shards (50,257 ids) cannot feed a model whose embedding has fewer rows: a clear error, before any shard is read."
    import json
    from rtrainer.training import TrainingData
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": {"name": "r50k_base", "vocab_size": 50257},
                                                        "shards": [{"file": "x-train-00000.tok", "split": "train"}]}))
    with pytest.raises(ValueError, match="50257 ids but the model's vocab_size is 32004"):
        TrainingData(str(tmp_path), 0, 32004)


def test_captured_step_body_trains_as_the_eager_step_on_the_kernels(tmp_path):
    "The --cuda-graph step body, run eagerly on the Triton kernels (interpreter): the optimizer's scalars in device memory; bit for bit the eager step."
    from rtrainer.training import CapturedStep, resolved
    out = {}
    for captured in (False, True):
        t = Trainer(cfg(tmp_path / str(captured), steps=2), model_config("tiny", impl="triton", vocab_size=512), log=quiet)
        assert t.optimizer.impl == "triton"
        if captured: t.captured = CapturedStep(t, capture=False)
        rows = [resolved(t.train_step(i)) for i in range(2)]
        t.check_step()
        out[captured] = ([r["loss"] for r in rows], {n: p.detach().clone() for n, p in t.model.named_parameters()})
        if captured: assert all(getattr(p, "main_grad", None) is not None for p in t.optimizer.params if p.ndim == 2)   # written by the backward
    assert out[True][0] == out[False][0]
    assert all(torch.equal(out[True][1][n], out[False][1][n]) for n in out[False][1])

def test_every_train_flag_explains_itself(capsys):
    "Each TrainConfig field carries help text, and `rtrainer train --help` shows it beside its flag."
    import dataclasses
    from rtrainer.cli import main
    fields = dataclasses.fields(TrainConfig)
    assert all(f.metadata.get("help") for f in fields), [f.name for f in fields if not f.metadata.get("help")]
    with pytest.raises(SystemExit) as e: main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")   # argparse wraps lines, at hyphens too
    for f in fields:
        if f.name in ("model", "betas"): continue
        assert f.metadata["help"][:30].replace("- ", "-") in text, f.name

def test_cuda_graph_flags(tmp_path):
    "No flag: the graph wherever it applies (auto); --cuda-graph insists (on); --no-cuda-graph gives eager steps (off)."
    import argparse
    from rtrainer.settings import add_train_arguments
    from rtrainer.training import train_config_from_args
    p = argparse.ArgumentParser(); add_train_arguments(p)
    modes = [train_config_from_args(p.parse_args(argv)).cuda_graph for argv in ([], ["--cuda-graph"], ["--no-cuda-graph"])]
    assert modes == ["auto", "on", "off"]
    assert cli("train", "--data", "synthetic", "--device", "cpu", "--cuda-graph", "--no-progress", "--out-dir", tmp_path) == 2   # refused on a CPU


# ---------------------------------------------------------------- nothing lost, nothing trusted blindly (issue #37)

def one_line_error(capsys, status, *fragments, err=None):
    "The command failed as a user error: status 2 and one line on stderr (or in `err`) holding every fragment."
    err = (capsys.readouterr().err if err is None else err).strip().splitlines()
    assert status == 2 and len(err) == 1, (status, err)
    for fragment in fragments: assert fragment in err[0], (fragment, err[0])
    return err[0]


def test_a_non_finite_parameter_is_never_saved(tmp_path, capsys):
    "An update that leaves a NaN in a weight (its loss was finite) stops the run before the save, saying which checkpoint is last."
    t = Trainer(cfg(tmp_path, steps=4, checkpoint_every=1), model_config("tiny", vocab_size=512), log=quiet)
    real = t.optimizer.step
    def poisoned(lr, grad_scale=None):
        real(lr, grad_scale=grad_scale)
        if t.optimizer.step_count == 2:
            with torch.no_grad(): t.model.lm_head.view(-1)[torch.randint(0, t.model.lm_head.numel(), ())] = float("nan")
    t.optimizer.step = poisoned
    with pytest.raises(NonFiniteLoss) as stop: t.run()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000001.safetensors"]
    assert "step 2: a parameter or a moment is NaN or infinite" in str(stop.value) and "nothing was saved" in str(stop.value)
    assert f"the last checkpoint is {folder / 'step-00000001.safetensors'}" in str(stop.value)
    tensors, _ = read_checkpoint(folder)
    assert all(torch.isfinite(v).all() for v in tensors.values() if v.is_floating_point())
    with pytest.raises(NonFiniteLoss, match="holds a NaN or an infinity"):       # the library call refuses it as well
        save_checkpoint(tmp_path / "nan.safetensors", t.model, t.optimizer, 2, t.cfg)
    assert not (tmp_path / "nan.safetensors").exists()
    for bad in ("nan", "inf", "-inf"):                                           # a learning rate that is no number: refused
        status = cli("train", "--data", "synthetic", f"--lr={bad}", "--no-progress", "--out-dir", tmp_path / "o")
        one_line_error(capsys, status, "--lr must be a finite number")
    assert not (tmp_path / "o").exists()


def rewrite_checkpoint(path, out, meta_edit=None, flip=None):
    "Copy a safetensors checkpoint to `out`, its rtrainer metadata edited by `meta_edit`, or one bit of tensor `flip` flipped."
    import struct
    data = bytearray(Path(path).read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    if meta_edit:
        meta = json.loads(header["__metadata__"]["rtrainer"]); meta_edit(meta)
        header["__metadata__"]["rtrainer"] = json.dumps(meta)
    if flip:
        start, end = header[flip]["data_offsets"]
        body[start + (end - start) // 3] ^= 0x20
    raw = json.dumps(header).encode(); raw += b" " * (-len(raw) % 8)
    Path(out).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(body))
    return out


def test_checkpoints_are_checked_on_load(tmp_path, capsys):
    "Metadata that does not match the tensors is refused naming the field; a flipped bit or an edited field fails its checksum."
    Trainer(cfg(tmp_path, steps=1), model_config("tiny", vocab_size=512), log=quiet).run()
    good = tmp_path / "run" / "checkpoints" / "step-00000001.safetensors"
    def field(name, value): return lambda meta: meta["model_config"].update({name: value})
    cases = [(dict(meta_edit=field("n_layers", 1)), "n_layers is 1, the file holds 2 blocks"),
             (dict(meta_edit=field("d_model", 96)), "d_model is 96"),
             (dict(meta_edit=field("vocab_size", 256)), "vocab_size is 256"),
             (dict(meta_edit=field("d_ff", 128)), "d_model, d_ff make it"),
             (dict(meta_edit=lambda meta: meta["model_config"].update(n_experts=4, expert_d_ff=32)), "n_experts"),
             (dict(meta_edit=lambda meta: meta.update(step=7)), "its metadata does not match its checksum"),
             (dict(meta_edit=lambda meta: meta["optimizer"].update(lr=1.0)), "its metadata does not match its checksum"),
             (dict(flip="model.lm_head"), "tensor model.lm_head does not match its CRC-32"),
             (dict(flip="optim.exp_avg_sq.blocks.1.qkv"), "tensor optim.exp_avg_sq.blocks.1.qkv does not match its CRC-32")]
    for i, (edit, message) in enumerate(cases):
        bad = rewrite_checkpoint(good, tmp_path / f"bad{i}.safetensors", **edit)
        with pytest.raises(ValueError, match=re.escape(message)): read_checkpoint(bad)
        one_line_error(capsys, cli("eval", "--checkpoint", bad, "--data", tmp_path, "--device", "cpu"), message)
        one_line_error(capsys, cli("generate", "--checkpoint", bad, "--prompt", "The", "--device", "cpu"), message)
        with pytest.raises(ValueError, match=re.escape(message)):
            Trainer(cfg(tmp_path, steps=2, resume=str(bad), out_dir=str(tmp_path / f"r{i}")), model_config("tiny", vocab_size=512), log=quiet)
    model, meta = training.load_model(good, device="cpu")                         # the untouched file still loads
    assert meta["step"] == 1 and len(model.blocks) == 2


def test_runs_never_share_a_folder(tmp_path, monkeypatch, capsys):
    """A second run of a preset gets its own folder; a fresh run refuses another run's; --resume refuses another run's data
    or settings unless told; a resume with nothing left to do says so and writes nothing."""
    monkeypatch.chdir(tmp_path)
    flags = ["--data", "synthetic", "--vocab-size", "512", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0",
             "--device", "cpu", "--no-progress", "--sample-tokens", "4"]
    assert cli("train", "--steps", 2, *flags) == 0
    first = {p: p.read_bytes() for p in Path("runs/tiny").rglob("*") if p.is_file()}
    assert cli("train", "--steps", 3, "--seed", 5, *flags) == 0                  # the default folder is taken: runs/tiny-2
    assert "runs/tiny holds another run: this run writes to runs/tiny-2" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in Path("runs/tiny").rglob("*") if p.is_file()} == first
    assert [p.name for p in Path("runs/tiny-2/checkpoints").iterdir()] == ["step-00000003.safetensors"]
    one_line_error(capsys, cli("train", "--steps", 3, *flags, "--out-dir", "runs/tiny"), "runs/tiny holds another run")
    one_line_error(capsys, cli("train", "--steps", 3, *flags, "--out-dir", "elsewhere", "--checkpoint-dir", "runs/tiny-2/checkpoints"),
                   "runs/tiny-2/checkpoints holds checkpoints of another run")
    one_line_error(capsys, cli("train", "--steps", 4, "--seed", 5, "--lr", "1e-3", *flags, "--resume", "runs/tiny-2/checkpoints"),
                   "this run differs from the checkpoint's: --lr 0.001 (checkpoint 0.003)", "--allow-resume-changes")
    one_line_error(capsys, cli("train", "--steps", 4, *flags, "--resume", "runs/tiny-2/checkpoints"), "--seed 0 (checkpoint 5)")
    one_line_error(capsys, cli("train", "--steps", 4, "--seed", 5, *flags, "--batch-size", 4, "--resume", "runs/tiny-2/checkpoints"),
                   "global batch 4 (checkpoint 2)")
    assert {p: p.read_bytes() for p in Path("runs/tiny").rglob("*") if p.is_file()} == first
    stamp = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in Path("runs").rglob("*") if p.is_file()}
    for steps in (2, 1):                                                          # at or past --steps: nothing to do
        assert cli("train", "--steps", steps, *flags, "--resume", "runs/tiny/checkpoints") == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert out == [f"nothing to do: runs/tiny/checkpoints/step-00000002.safetensors is at step 2 and --steps is {steps}; nothing was written"]
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in Path("runs").rglob("*") if p.is_file()} == stamp
    assert cli("train", "--steps", 4, "--seed", 5, "--lr", "1e-3", "--allow-resume-changes", *flags, "--resume", "runs/tiny-2/checkpoints") == 0
    assert sorted(p.name for p in Path("runs/tiny-2/checkpoints").iterdir()) == ["step-00000003.safetensors", "step-00000004.safetensors"]
    with pytest.raises(FileExistsError, match="never rewrites"):                 # and no save goes over an existing file
        t = Trainer(cfg(tmp_path, steps=3), model_config("tiny", vocab_size=512), log=quiet)
        t.checkpoint_dir, t.step = Path("runs/tiny-2/checkpoints"), 3
        t.save()
    assert stamp[Path("runs/tiny-2/checkpoints/step-00000003.safetensors")][1] == Path("runs/tiny-2/checkpoints/step-00000003.safetensors").read_bytes()


def test_sigterm_saves_at_the_next_step_boundary(tmp_path, monkeypatch, capsys):
    """SIGTERM (sent from outside, to a real process) stops a run at a step boundary with a checkpoint and one line;
    SIGINT with --on-signal exit stops it without one; a resume removes what a kill during a save left."""
    import signal, time
    flags = ["train", "--data", "synthetic", "--vocab-size", "512", "--batch-size", "2", "--seq-len", "16", "--log-every", "1",
             "--eval-every", "0", "--device", "cpu", "--no-progress"]
    out = tmp_path / "save"
    proc = subprocess.Popen([sys.executable, "-m", "rtrainer", *flags, "--steps", "100000", "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    [path] = (out / "checkpoints").iterdir()
    step = int(path.stem.split("-")[1])
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines() == [f"rtrainer train: SIGTERM at step {step}: saved {path}; continue with --resume {path}"]
    _, meta = read_checkpoint(path)
    assert meta["step"] == step >= 2 and meta["optimizer"]["step_count"] == step

    real = training.Trainer.train_step
    def interrupted(self, i):                                     # a Ctrl-C during step 3
        if i == 2: os.kill(os.getpid(), signal.SIGINT)
        return real(self, i)
    monkeypatch.setattr(training.Trainer, "train_step", interrupted)
    before = signal.getsignal(signal.SIGINT)     # Python's default_int_handler, or SIG_IGN in a process started in the background
    assert cli(*flags, "--steps", 100, "--on-signal", "exit", "--out-dir", tmp_path / "exit") == 128 + signal.SIGINT
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rtrainer train: SIGINT at step 3: stopped without saving (--on-signal exit); this run saved no checkpoint"], err
    assert not list((tmp_path / "exit" / "checkpoints").glob("*"))
    assert signal.getsignal(signal.SIGINT) is before      # the run put the handler back
    monkeypatch.setattr(training.Trainer, "train_step", real)

    leftovers = [path.parent / f".step-{step + 1:08d}.safetensors.tmp-4242", path.parent / f".step-{step + 1:08d}.tmp", path.parent / ".tmpAb3dEf"]
    leftovers[1].mkdir(); (leftovers[1] / "__0_0.distcp").write_bytes(b"\0" * 4096)     # what kills during saves leave: a DCP
    leftovers[0].mkdir(); (leftovers[0] / ".tmpQ1w2E3").write_bytes(b"\0" * 4096)     # folder, a save's folder holding
    leftovers[2].write_bytes(b"\0" * 4096)                                          # safetensors' temporary file, or that file
    assert cli(*flags, "--steps", step + 1, "--resume", path) == 0                  # alone (earlier versions)
    assert "removed 3 temporary file(s) of an interrupted save" in capsys.readouterr().out and not any(p.exists() for p in leftovers)
    assert read_checkpoint(path.parent)[1]["step"] == step + 1


@pytest.mark.parametrize("argv, message", [
    (["train", "--lr", "nan"], "--lr must be a finite number"),
    (["train", "--clip", "-1"], "--clip must be >= 0"),
    (["train", "--eps", "0"], "--eps must be positive"),
    (["train", "--weight-decay", "inf"], "--weight-decay must be a finite number"),
    (["train", "--floor", "nan"], "--floor must be a finite number"),
    (["train", "--capacity-factor", "nan"], "--capacity-factor must be a finite number"),
    (["train", "--cuda-graph", "--no-cuda-graph"], "--cuda-graph and --no-cuda-graph contradict each other"),
    (["train", "--no-checkpoints", "--checkpoint-every", "1"], "--no-checkpoints and --checkpoint-every 1 contradict"),
    (["train", "--init-moments"], "--init-moments takes the moments of --init-from's checkpoint"),
    (["train", "--allow-resume-changes"], "--allow-resume-changes applies to --resume"),
    (["train", "--skip-batches", "2"], "--skip-batches applies to --resume"),
    (["train", "--skip-batches", "-1"], "--skip-batches must be >= 0"),
    (["train", "--memory-budget", "8", "--device", "cpu"], "--memory-budget measures a GPU's peak memory; this run is on cpu"),
    (["train", "--memory-budget", "-1"], "--memory-budget must be >= 0"),
    (["train", "--memory-budget", "8", "--nproc", "2"], "--memory-budget runs in one process"),
    (["train", "--activation-checkpointing", "some"], "--activation-checkpointing must be one of none, selective, full"),
    (["train", "--on-signal", "ignore"], "--on-signal must be one of save, exit"),
    (["train", "--device", "foo"], "--device 'foo' is not a device"),
    (["train", "--device", "cuda:7"], "--device cuda:7"),
    (["train", "--sample-tokens", "256"], "--sample-tokens 256 must be below the model's max_seq_len 256"),
    (["train", "--steps", "many"], "argument --steps: invalid int value: 'many'"),
    (["generate", "--checkpoint", "CK", "--prompt", "a", "--top-k", "-3"], "--top-k must be an integer >= 0"),
    (["generate", "--checkpoint", "CK", "--prompt", "a", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["generate", "--checkpoint", "CK", "--prompt", "a", "--device", "foo"], "--device 'foo' is not a device"),
    (["eval", "--checkpoint", "CK", "--data", "DATA", "--batch-size", "0"], "--batch-size must be an integer >= 1"),
])
def test_every_flag_is_checked(tmp_path, capsys, argv, message):
    "A value out of range, a number that is not finite, contradictory flags: one line on stderr, status 2, nothing written."
    import torch
    if "cuda:7" in argv and torch.cuda.device_count() > 7: pytest.skip("this machine has a cuda:7")
    argv = [str(tmp_path / "none.safetensors") if a == "CK" else str(tmp_path) if a == "DATA" else a for a in argv]
    extra = (["--data", "synthetic", "--out-dir", str(tmp_path / "o"), "--no-progress", "--vocab-size", "512", "--seq-len", "8",
              "--batch-size", "2"] + ([] if "--steps" in argv else ["--steps", "1"]) if argv[0] == "train" else [])
    try: status = main(argv + extra)
    except SystemExit as e: status = e.code                       # the parser's own errors
    one_line_error(capsys, status, message)
    assert not (tmp_path / "o").exists()


def test_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch, capsys):
    "A file-size limit (as a full disk): `prepare` and a checkpoint save fail with one line; the folders hold nothing half-written."
    import resource, signal
    monkeypatch.chdir(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    try:
        prepared = cli("prepare", "--out", tmp_path / "docs")
        prepare_err = capsys.readouterr().err
        trained = cli("train", "--data", "synthetic", "--steps", 1, "--batch-size", 2, "--seq-len", 8, "--device", "cpu",
                      "--no-progress", "--eval-every", 0, "--out-dir", tmp_path / "run")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)); signal.signal(signal.SIGXFSZ, old_handler)
    one_line_error(capsys, prepared, "python-docs-train-00000.tok: File too large", err=prepare_err)
    one_line_error(capsys, trained, "step 1: the checkpoint was not saved", "File too large", "this run saved no checkpoint")
    assert [p.name for p in (tmp_path / "docs").iterdir()] == []
    assert list((tmp_path / "run" / "checkpoints").iterdir()) == []


def test_a_log_file_gets_plain_rows_not_a_progress_bar(tmp_path):
    "Output to a file (not a terminal): no carriage-return bar, a plain row every --log-every steps instead."
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-m", "rtrainer", "train", "--data", "synthetic", "--steps", "6", "--log-every", "2",
                            "--eval-every", "0", "--batch-size", "2", "--seq-len", "16", "--vocab-size", "512", "--device", "cpu",
                            "--no-checkpoints", "--out-dir", str(tmp_path / "o")], stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert r.returncode == 0, text
    assert "\r" not in text
    assert [int(l.split()[0]) for l in text.splitlines() if re.match(r"\s+\d+\s", l)] == [2, 4, 6]
