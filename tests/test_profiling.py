"Tests of the profiling chapter (CPU): profiler phases, the paired interval, the baseline's accounting, versus and ab."
import json, math
import pytest, torch
from rtrainer.model import model_config, parameter_counts, TransformerLm
from rtrainer.training import NonFiniteLoss
from rtrainer.profiling import (PHASES, profile_trainer, profile_step, profile_graph_step, attribute_device_events,
                                PlainTransformer, PlainAdamW, plain_parameter_counts, check_parameter_counts, dtype_census,
                                versus, run_arm, ab, tokens_per_s_from_metrics, changed_rows)
from rtrainer.kernels import ratio_interval, t_quantile_975   # the paired statistics live in the kernels chapter

SMALL_VOCAB = 512   # keeps the tiny model's lm-head small so every step takes milliseconds on a CPU

def test_profile_cpu_phases():
    trainer = profile_trainer("tiny", batch_size=3, seq_len=24, vocab_size=SMALL_VOCAB)
    report = profile_step(trainer)
    print({k: round(v, 3) for k, v in report["phases_ms"].items()}, "full step", round(report["full_step_ms"], 3))
    assert sorted(report["phases_ms"]) == sorted(PHASES)
    assert all(v > 0 for v in report["phases_ms"].values())
    assert sum(report["phases_ms"].values()) <= report["full_step_ms"]
    assert 0 < report["kernel_sum_ms"] <= report["full_step_ms"] and math.isfinite(report["loss"])
    assert {r["name"].split(".")[0] for r in report["rows"]} <= set(PHASES)
    assert any(r["name"].startswith("backward.") for r in report["rows"])

def test_profile_command_writes_its_report(tmp_path, capsys):
    "`rtrainer profile` on a CPU: table printed, JSON report written, its device the torch device and the machine's GPU apart."
    from rtrainer.cli import main
    out = tmp_path / "report.json"
    assert main(["profile", "--config", "tiny", "--batch-size", "2", "--seq-len", "16", "--vocab-size", str(SMALL_VOCAB), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and "gpu" in report and report["config"] == "tiny"
    assert "all ops" in capsys.readouterr().out

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_graph_profile_refused_on_a_cpu(capsys):
    "`profile --cuda-graph` on a machine without a GPU: exit 2 and one line that says so; profile_graph_step refuses an eager trainer."
    from rtrainer.cli import main
    assert main(["profile", "--config", "tiny", "--cuda-graph", "--vocab-size", str(SMALL_VOCAB)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cuda-graph needs a CUDA device" in err[0], err
    with pytest.raises(ValueError, match="must be a CUDA graph on a GPU"):
        profile_graph_step(profile_trainer("tiny", batch_size=2, seq_len=16, vocab_size=SMALL_VOCAB))

def test_attribution_by_launch_time():
    ranges = [("forward", 0, 10), ("backward", 10, 50), ("optimizer", 60, 70)]
    launches = {7: 5, 8: 12, 9: 55, 10: 65}
    rows = attribute_device_events(ranges, launches, [("k", 7, 1e6), ("k", 8, 2e6), ("gap", 9, 3e6), ("k", 10, 4e6), ("k", 8, 1e6)])
    got = {r["name"]: (r["ms"], r["calls"]) for r in rows}
    assert got == {"forward.k": (1.0, 1), "backward.k": (3.0, 2), "other.gap": (3.0, 1), "optimizer.k": (4.0, 1)}
    assert [r["name"] for r in rows][0] == "optimizer.k"     # largest first

def test_ratio_interval_by_hand():
    ratios = [0.97, 1.04, 1.01, 0.99, 1.08]
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 4)
    half = 2.776 * sd / math.sqrt(5)
    got = ratio_interval(ratios)
    expected = (math.exp(mean), math.exp(mean - half), math.exp(mean + half))
    print("interval", got, "expected", expected)
    assert all(abs(a - b) < 1e-12 for a, b in zip(got, expected))
    assert t_quantile_975(1) == 12.706 and t_quantile_975(22) == 2.086 and t_quantile_975(1000) == 1.96
    with pytest.raises(ValueError): ratio_interval([])

def test_parameter_count_mismatch_is_caught():
    for name in ["tiny", "tiny_moe"]:
        c = model_config(name, vocab_size=SMALL_VOCAB)
        check_parameter_counts(plain_parameter_counts(PlainTransformer(c, device="cpu")), parameter_counts(c))
    wrong = PlainTransformer(model_config("tiny", vocab_size=SMALL_VOCAB, n_kv_heads=4), device="cpu")
    with pytest.raises(ValueError, match="attention"):
        check_parameter_counts(plain_parameter_counts(wrong), parameter_counts(model_config("tiny", vocab_size=SMALL_VOCAB)))

def test_baseline_matches_rtrainer_in_float64():
    for name in ["tiny", "tiny_moe"]:
        c = model_config(name, vocab_size=SMALL_VOCAB + 37, impl="torch")
        ours = TransformerLm(c, device="cpu")
        plain = PlainTransformer(c, precision="fp32", device="cpu")
        with torch.no_grad():
            mine = dict(ours.named_parameters())
            for n, p in plain.named_parameters(): p.copy_(mine[n].detach() + 0.01 * torch.randn_like(p) * ("norm" in n))
            for n, p in ours.named_parameters(): p.copy_(dict(plain.named_parameters())[n])
        ours, plain = ours.double(), plain.double()
        ids = torch.randint(0, c.vocab_size, (3, 19)); tgt = torch.randint(0, c.vocab_size, (3, 19))
        ref = ours(ids, tgt, load_balance_weight=0.01)[0]
        got = plain(ids, tgt, load_balance_weight=0.01)[0]
        err = abs(got - ref).item() / abs(ref).item()
        print(name, "relative error", err)
        assert err < 1e-10

def test_plain_adamw_policy_and_math():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 7).to(torch.bfloat16)); n = torch.nn.Parameter(torch.randn(7))
    opt = PlainAdamW([("w", p), ("norm", n)], lr=1e-2, clip=0)
    w0, n0 = p.detach().double(), n.detach().double()
    gp, gn = torch.randn(5, 7).to(torch.bfloat16), torch.randn(7)
    p.grad, n.grad = gp.clone(), gn.clone()
    opt.step()
    def ref(w, g, decay):
        g = g.double(); m = 0.1 * g; v = 0.001 * g * g
        w = w * (1 - 1e-2 * 0.1) if decay else w
        return w - 1e-2 * (m / 0.1) / ((v / 0.001).sqrt() + 1e-8)
    err_w = (p.detach().double() - ref(w0, gp, True).to(torch.bfloat16).double()).abs().max().item()
    err_n = ((n.detach().double() - ref(n0, gn, False)).abs().max() / ref(n0, gn, False).abs().max()).item()
    print("bf16 master max difference", err_w, "fp32 norm relative error", err_n)
    assert err_w <= 2 ** -7 * ref(w0, gp, True).abs().max().item() and err_n < 1e-6
    assert p.dtype == torch.bfloat16 and set(dtype_census(torch.nn.ParameterList([p]), opt.exp_avg + opt.exp_avg_sq)["moments"]) == {"float32"}

def test_non_finite_loss_rejects_the_arm():
    res = run_arm(dict(arm="eager", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=2, seq_len=16, warmup=1, steps=2, lr=1e30))
    print(res.get("status"))
    assert "tokens_per_s" not in res and res["status"].startswith("rejected")
    res = run_arm(dict(arm="rtrainer", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=2, seq_len=16, warmup=1, steps=2, lr=1e30))
    assert "tokens_per_s" not in res and res["status"].startswith("rejected")

def test_metrics_window_and_gate(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [dict(step=1, loss=5.0, tokens_per_s=10.0), dict(step=2, loss=4.0, tokens_per_s=100.0), dict(step=3, loss=3.0, tokens_per_s=300.0)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    tps, timed = tokens_per_s_from_metrics(path, 1, 60)
    assert abs(tps - 2 * 60 / (60 / 100 + 60 / 300)) < 1e-9 and len(timed) == 2
    path.write_text("\n".join(json.dumps(r) for r in rows[:2] + [dict(step=3, loss=float("nan"), tokens_per_s=1.0)]))
    with pytest.raises(NonFiniteLoss): tokens_per_s_from_metrics(path, 1, 60)

def test_changed_rows():
    base = dict(rows=[dict(name="a", ms=1.0), dict(name="b", ms=2.0)], unattributed_ms=0.5, kernel_sum_ms=3.0)
    new = dict(rows=[dict(name="a", ms=1.01), dict(name="c", ms=0.3)], unattributed_ms=0.5, kernel_sum_ms=1.31)
    assert [n for n, _, _ in changed_rows(base, new)] == ["b", "kernel_sum_ms", "c"]

def test_versus_tiny_eager_in_processes():
    rows, raw = versus("tiny", tiers=("eager",), rounds=2, steps=2, warmup=1, batch_size=2, seq_len=16, save=False, vocab_size=SMALL_VOCAB)
    by = {r["arm"]: r for r in rows}
    assert by["rtrainer"]["rounds"] == by["eager"]["rounds"] == 2
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(raw["rtrainer"], raw["eager"])]
    assert all(abs(x - y) < 1e-9 for x, y in zip(ratio_interval(ratios), (by["eager"]["rtrainer/arm"], by["eager"]["ci95_low"], by["eager"]["ci95_high"])))
    assert set(raw["eager"][0]["census"]["moments"]) == {"float32"}

def test_ab_head_against_head():
    rows = ab("HEAD", "HEAD", config="tiny", rounds=1, steps=1, warmup=1, batch_size=2, seq_len=16, extra=["--vocab-size", str(SMALL_VOCAB)])
    assert [r["arm"] for r in rows] == ["A", "B"] and rows[0]["commit"] == rows[1]["commit"]
    assert rows[0]["tokens_per_s"] > 0 and rows[1]["A/arm"] > 0

def test_worktree_arm_refuses_foreign_or_dirty_code():
    from rtrainer.profiling import Worktree, run_in_worktree, PROJECT_ROOT
    with Worktree("HEAD") as tree:
        ok = run_in_worktree(tree, ["--help"])
        assert ok.returncode == 0 and f"arm commit {tree.commit}" in ok.stdout
        foreign = run_in_worktree(tree, ["--help"], cwd=PROJECT_ROOT, env={**tree.env(), "PYTHONPATH": str(PROJECT_ROOT)})  # the main checkout
        print(foreign.stderr.strip())
        assert foreign.returncode != 0 and "outside the worktree" in foreign.stderr
        (tree.path / "stray.py").write_text("x = 1\n")
        dirty = run_in_worktree(tree, ["--help"])
        print(dirty.stderr.strip())
        assert dirty.returncode != 0 and "is not commit" in dirty.stderr
    assert not tree.path.exists()

def test_versus_interrupted_keeps_the_finished_arms(tmp_path, monkeypatch):
    "Ctrl-C in round 2: round 1's arms are summarized and saved beside (not over) the complete record, and the interrupt goes on."
    import rtrainer.profiling as prof, rtrainer.kernels as kernels
    monkeypatch.setattr(kernels, "RESULTS_DIR", tmp_path)
    (tmp_path / "versus_tiny.json").write_text("complete")
    calls = []
    def fake_arm(spec):
        calls.append(spec["arm"])
        if len(calls) == 3: raise KeyboardInterrupt
        rate = 100.0 if spec["arm"] == "rtrainer" else 80.0 + len(calls)
        return dict(arm=spec["arm"], tokens_per_s=rate, mfu=0.1, peak_memory_gib=1.0)
    monkeypatch.setattr(prof, "run_arm", fake_arm)
    with pytest.raises(KeyboardInterrupt): versus("tiny", tiers=("eager",), rounds=3, isolate=False, log=lambda *a: None)
    assert (tmp_path / "versus_tiny.json").read_text() == "complete"
    saved = json.loads((tmp_path / "versus_tiny_interrupted.json").read_text())
    assert saved["interrupted"] == "interrupted at B=8 in round 2 of 3"
    by = {r["arm"]: r for r in saved["rows"]}
    assert by["rtrainer"]["rounds"] == by["eager"]["rounds"] == 1
    first_eager = 100.0 / next(r["tokens_per_s"] for r in saved["raw"]["eager"])
    assert abs(by["eager"]["rtrainer/arm"] - first_eager) < 1e-12

def test_versus_save_as_keeps_the_record(tmp_path, monkeypatch):
    "`rtrainer versus --save-as NAME`: a run of other tiers is saved under NAME; versus_CONFIG.json is not touched."
    import argparse
    import rtrainer.profiling as prof, rtrainer.kernels as kernels
    monkeypatch.setattr(kernels, "RESULTS_DIR", tmp_path)
    (tmp_path / "versus_tiny.json").write_text("the default tier's record")
    rates = {"rtrainer": iter([100.0, 101.0]), "max-autotune-no-cudagraphs": iter([90.0, 92.0])}
    monkeypatch.setattr(prof, "run_arm_process", lambda spec, timeout=None: dict(arm=spec["arm"], tokens_per_s=next(rates[spec["arm"]]), mfu=0.1))
    from rtrainer.cli import add_versus_arguments; p = argparse.ArgumentParser(); add_versus_arguments(p)
    args = p.parse_args(["--config", "tiny", "--tiers", "max-autotune-no-cudagraphs", "--rounds", "2", "--save-as", "versus_tiny_autotune"])
    assert prof.run_versus(args) == 0
    assert (tmp_path / "versus_tiny.json").read_text() == "the default tier's record"
    saved = json.loads((tmp_path / "versus_tiny_autotune.json").read_text())
    by = {r["arm"]: r for r in saved["rows"]}
    assert by["max-autotune-no-cudagraphs"]["rounds"] == 2
    assert abs(by["max-autotune-no-cudagraphs"]["tokens_per_s"] - 91.0) < 1e-9
    for bad in ("../elsewhere", "", ".hidden"):     # refused before any arm runs
        with pytest.raises(ValueError, match="save_as must be a plain file name"): versus("tiny", save_as=bad)

def test_ab_passes_train_flags_to_both_arms(monkeypatch):
    "`rtrainer ab --train-flags ...` hands the flags, split as a shell would, to every arm's `rtrainer train`."
    import argparse
    import rtrainer.profiling as profiling
    seen = {}
    monkeypatch.setattr(profiling, "ab", lambda *args, **kw: seen.update(kw))
    from rtrainer.cli import add_ab_arguments; p = argparse.ArgumentParser(); add_ab_arguments(p)
    assert profiling.run_ab(p.parse_args(["--config", "tiny", "--train-flags", "--no-cuda-graph --lr '3e-4'"])) == 0
    assert seen["extra"] == ["--no-cuda-graph", "--lr", "3e-4"]


def test_autocast_tier_runs_under_its_own_policy():
    "The stock tier (fp32 masters, autocast, torch's AdamW): a number, and a census that says what it holds."
    res = run_arm(dict(arm="autocast-eager", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=2, seq_len=16, warmup=1, steps=2))
    print(res.get("status"), res["census"])
    assert res["tokens_per_s"] > 0 and res["census"]["violations"] == []
    assert set(res["census"]["params"]) == set(res["census"]["grads"]) == set(res["census"]["moments"]) == {"float32"}


def test_an_arm_off_its_precision_policy_is_refused(monkeypatch):
    "Masters (or gradients, or moments) that are not the arm's policy: the arm reports no throughput, and says why."
    import rtrainer.profiling as prof
    real_init = prof.PlainTransformer.__init__
    def bf16_masters(self, c, precision="bf16", device=None): real_init(self, c, "bf16", device)   # the CPU's policy is fp32
    monkeypatch.setattr(prof.PlainTransformer, "__init__", bf16_masters)
    res = run_arm(dict(arm="eager", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=2, seq_len=16, warmup=1, steps=1))
    print(res["status"])
    assert "tokens_per_s" not in res and res["status"].startswith("refused") and "bfloat16" in res["status"]
    assert dtype_census(TransformerLm(model_config("tiny", vocab_size=SMALL_VOCAB)), masters="fp32")["violations"] == []
    bad = TransformerLm(model_config("tiny", vocab_size=SMALL_VOCAB)).half()
    assert any("float16" in v for v in dtype_census(bad, masters="fp32")["violations"])


def test_versus_batches_keeps_an_out_of_memory_row(tmp_path, monkeypatch):
    "`rtrainer versus --batches 2,4`: one comparison per batch size, saved together; an arm out of memory is a row that says so."
    import argparse
    import rtrainer.profiling as prof, rtrainer.kernels as kernels
    monkeypatch.setattr(kernels, "RESULTS_DIR", tmp_path)
    real_plain = prof._plain_arm
    def plain(spec, mcfg, device):
        if spec["batch_size"] == 4: raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB")
        return real_plain(spec, mcfg, device)
    monkeypatch.setattr(prof, "_plain_arm", plain)
    monkeypatch.setattr(prof, "run_arm_process", lambda spec, timeout=None: prof.run_arm({**spec, "overrides": dict(vocab_size=SMALL_VOCAB)}))
    from rtrainer.cli import add_versus_arguments; p = argparse.ArgumentParser(); add_versus_arguments(p)
    args = p.parse_args(["--config", "tiny", "--tiers", "eager", "--rounds", "1", "--steps", "1", "--warmup", "1", "--seq-len", "16", "--batches", "2,4"])
    assert prof.run_versus(args) == 0
    rows = json.loads((tmp_path / "versus_tiny.json").read_text())["rows"]
    by = {(r["batch_size"], r["arm"]): r for r in rows}
    assert set(by) == {(2, "rtrainer"), (2, "eager"), (4, "rtrainer"), (4, "eager")}
    assert by[(2, "eager")]["tokens_per_s"] > 0 and by[(4, "rtrainer")]["tokens_per_s"] > 0
    assert by[(4, "eager")]["status"] == "out of memory" and "tokens_per_s" not in by[(4, "eager")]
    for bad in (["--batches", "16,x"], ["--batches", "0"], ["--batches", "16", "--batch-size", "8"]):
        with pytest.raises(ValueError, match="--batch"): prof.run_versus(p.parse_args(["--config", "tiny", *bad]))

def test_versus_kept_arms_build_once_and_time_every_round():
    "--keep-arms: one process per arm and batch size, built once (the same compile time in every round), timed each round."
    rows, raw = versus("tiny", tiers=("eager",), rounds=3, steps=2, warmup=1, batch_size=[1, 3], seq_len=16, save=False,
                       keep_arms=True, log=lambda *a: None, vocab_size=SMALL_VOCAB)
    assert sorted(raw) == [1, 3] and [r["batch_size"] for r in rows] == [1, 1, 3, 3]
    for B, results in raw.items():
        for arm in ("rtrainer", "eager"):
            runs = results[arm]
            assert len(runs) == 3 and all(r["tokens_per_s"] > 0 and r["batch_size"] == B for r in runs)
            assert len({r["compile_s"] for r in runs}) == 1            # one build and warm-up, not one per round
            assert all(math.isfinite(r["final_loss"]) for r in runs)
    by = {(r["batch_size"], r["arm"]): r for r in rows}
    assert by[(3, "eager")]["rounds"] == 3 and by[(3, "eager")]["ci95_low"] <= by[(3, "eager")]["rtrainer/arm"] <= by[(3, "eager")]["ci95_high"]

def test_versus_kept_arm_that_cannot_build_fails_every_round_and_ends():
    from rtrainer.profiling import KeptArms
    spec = dict(arm="eager", config="tiny", overrides=dict(n_heads=5), batch_size=1, seq_len=16, warmup=1, steps=1)  # 5 heads: invalid
    kept = KeptArms({"eager": spec, "rtrainer": dict(spec, arm="rtrainer")})
    try:
        first, second = kept.measure("eager"), kept.measure("eager")
        assert first == second and "tokens_per_s" not in first and first["status"].startswith("failed")
    finally: kept.close()
    assert all(k.proc.poll() is not None for k in kept.arms.values())
    with pytest.raises(ValueError, match="keep_arms"): versus("tiny", keep_arms=True, isolate=False)

def test_kept_arm_timeout_kills_it():
    from rtrainer.profiling import KeptArm
    kept = KeptArm(dict(arm="eager", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=1, seq_len=16, warmup=1, steps=1))
    res = kept.reply(timeout=0.01)                # no process imports torch in 10 ms
    assert res["status"] == "timed out after 0.01 s" and kept.proc.poll() is not None

def test_run_arm_process_is_one_kept_arm_measured_once(monkeypatch):
    "A fresh process builds, times once and ends; a build failure and a time limit come back as statuses."
    from rtrainer import profiling as prof
    started = []
    class Counting(prof.KeptArm):
        def __init__(self, spec): super().__init__(spec); started.append(self)
    monkeypatch.setattr(prof, "KeptArm", Counting)
    spec = dict(arm="eager", config="tiny", overrides=dict(vocab_size=SMALL_VOCAB), batch_size=2, seq_len=16, warmup=1, steps=2)
    res = prof.run_arm_process(spec, timeout=120)
    assert res["tokens_per_s"] > 0 and math.isfinite(res["final_loss"]) and res["compile_s"] >= 0
    bad = prof.run_arm_process(dict(spec, overrides=dict(n_heads=5)))       # 5 heads do not divide d_model: the build fails
    assert "tokens_per_s" not in bad and bad["status"].startswith("failed")
    late = prof.run_arm_process(spec, timeout=0.01)
    assert late["status"] == "timed out after 0.01 s"
    assert len(started) == 3 and all(k.proc.poll() is not None for k in started)   # every process ended
