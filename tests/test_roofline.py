"The roofline of a training step (profiling chapter): analytic FLOPs and bytes, the kernel classifier, the report's sums."
import json
from pathlib import Path
import pytest
import torch
from rtrainer.attention import attention_flops
from rtrainer.kernels import load_results, COPY_CEILING_GBPS
from rtrainer.model import model_config, flops_per_token, REFERENCE_BATCH, TransformerLm
from rtrainer.profiling import (step_kernels, step_floor, kernel_floor_ms, kernel_family, measured_families, roofline_report,
                                roofline_suite, ROOFLINE_FAMILIES, GEMM_CEILING_TFLOPS, H200_CEILINGS, profile_trainer, profile_step)

ODD_SHAPES = [("rb100m", 3, 77), ("prof183m", 1, 1024), ("dense1b", 5, 33), ("moe4b", 2, 129), ("tiny_moe", 7, 19), ("tiny", 1, 1)]

@pytest.mark.parametrize("name,B,T", ODD_SHAPES)
def test_flops_agree_with_the_mfu_accounting(name, B, T):
    "GEMM + router FLOPs are MFU's matmul term exactly; attention is 7/12 of MFU's attention term (causal half, recomputing backward)."
    c = model_config(name)
    f = step_floor(c, B, T)
    mfu = flops_per_token(c, T) * B * T
    matmul_term = 6 * B * T * (mfu // (B * T) - 12 * c.n_layers * T * c.n_heads * c.head_dim) // 6
    assert f["GEMM"]["flops"] + f["MoE routing"]["flops"] == matmul_term
    assert 7 * (mfu - matmul_term) == 12 * f["attention"]["flops"]
    assert f["attention"]["flops"] == 3.5 * attention_flops(B, c.n_heads, T, c.head_dim) * c.n_layers
    assert (f["MoE routing"]["flops"] > 0) == bool(c.n_experts)

@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_gemm_weights_are_the_models_matrices(name):
    "The forward GEMMs' weights, counted once per layer, are the model's matrix parameters (the tied table serving as lm-head)."
    c = model_config(name)
    model = TransformerLm(c, device="cpu")
    matrices = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n and "router" not in n)
    if not c.tie_embeddings: matrices -= model.embedding.numel()          # a lookup table, not a GEMM's weight
    B, T = 1, 1                                           # one token: a forward GEMM reads W and x, writes y
    gemm_weights = 0
    for k in step_kernels(c, B, T):
        if k["family"] == "GEMM" and k["name"].endswith(".forward"):
            d_in, d_out = _shape(c, k["name"])
            rows = c.top_k if k["name"].startswith("expert_") else 1    # the routed token count
            gemm_weights += k["bytes"] // 2 - k["calls"] * rows * (d_in + d_out)
    assert gemm_weights == matrices

def _shape(c, name):
    D, qkv = c.d_model, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return {"qkv.forward": (D, qkv), "attention_out.forward": (c.n_heads * c.head_dim, D), "gate_up.forward": (D, 2 * c.d_ff),
            "down.forward": (c.d_ff, D), "expert_gate_up.forward": (D, 2 * c.expert_d_ff), "expert_down.forward": (c.expert_d_ff, D),
            "shared_gate_up.forward": (D, 2 * c.expert_d_ff), "shared_down.forward": (c.expert_d_ff, D),
            "lm_head.forward": (D, c.padded_vocab_size)}[name]

def test_rms_norm_bytes_by_hand():
    "The first RMSNorm of rb100m at B=3, T=77: 231 rows of 768 bf16 values; read x, write y; backward read x, dy, write dx."
    kernels = {k["name"]: k for k in step_kernels(model_config("rb100m"), 3, 77)}
    assert kernels["rms_norm.forward"]["bytes"] == 2 * 231 * 768 * 2 == 709_632
    assert kernels["rms_norm.backward"]["bytes"] == 3 * 231 * 768 * 2
    assert kernels["rms_norm.forward"]["flops"] == 0
    assert kernels["rms_norm.forward"]["floor_ms"] == pytest.approx(709_632 / (COPY_CEILING_GBPS * 1e6))
    assert kernels["add_rms_norm.forward"]["calls"] == 2 * 16 and kernels["add_rms_norm.forward"]["bytes"] == 32 * 4 * 231 * 768 * 2

def test_adamw_bytes_follow_the_precision_policy():
    "bf16 matrices: 2 + 2 weight bytes and 20 of fp32 grad and moments; fp32 norms (and router): 4 + 4 + 20."
    for name in ["rb100m", "moe4b"]:
        c = model_config(name)
        adamw = next(k for k in step_kernels(c, 1, 8) if k["name"] == "adamw")
        from rtrainer.model import parameter_counts
        counts = parameter_counts(c)
        fp32 = counts["norms"] + sum(c.is_moe_layer(i) for i in range(c.n_layers)) * c.d_model * c.n_experts
        assert adamw["bytes"] == 24 * (counts["total"] - fp32) + 28 * fp32

def test_kernel_floor_is_the_slower_ceiling():
    measuring = "".join("".join(c["source"]) for c in json.loads((Path(__file__).parent.parent / "nbs" / "measuring.ipynb").read_text())["cells"])
    assert f"about {GEMM_CEILING_TFLOPS:g} TFLOP/s" in measuring     # the protocol's compute ceiling, stated where it is defined
    assert kernel_floor_ms(GEMM_CEILING_TFLOPS * 1e9, 0) == pytest.approx(1.0)          # 790 GFLOP: 1 ms
    assert kernel_floor_ms(1.0, COPY_CEILING_GBPS * 1e6) == pytest.approx(1.0)          # 4.26 GB: 1 ms
    assert kernel_floor_ms(2 * GEMM_CEILING_TFLOPS * 1e9, COPY_CEILING_GBPS * 1e6) == pytest.approx(2.0)

def test_floors_take_the_profiles_own_ceilings():
    "A profile that measured its GPU's ceilings gets floors at those: bytes-bound families scale with the copy ceiling alone."
    c, B, T = model_config("tiny_moe"), 3, 37
    slower = dict(gemm_tflops=GEMM_CEILING_TFLOPS / 3, copy_GBps=H200_CEILINGS["copy_GBps"] / 2, source="made up")
    at_h200 = {r["family"]: r for r in roofline_report(c, B, T)["families"]}
    report = roofline_report(c, B, T, profile=dict(ceilings=slower, rows=[dict(name="all kernels", ms=1.0)], full_step_without_profiler_ms=2.0))
    assert report["ceilings"] == slower and roofline_report(c, B, T)["ceilings"] == H200_CEILINGS
    ours = {r["family"]: r for r in report["families"]}
    for family in ("norms and pointwise", "optimizer"):                  # no FLOPs: twice the time at half the bandwidth
        assert at_h200[family]["floor_ms"] > 0 and ours[family]["floor_ms"] == pytest.approx(2 * at_h200[family]["floor_ms"], rel=1e-12)
    assert ours["GEMM"]["floor_ms"] == pytest.approx(sum(max(3 * k["flops"] / (GEMM_CEILING_TFLOPS * 1e9), k["bytes"] / (H200_CEILINGS["copy_GBps"] * 5e5))
                                                     for k in step_kernels(c, B, T) if k["family"] == "GEMM"), rel=1e-12)
    profile = dict(ceilings=slower, rows=[dict(name="all kernels", ms=1.0)], full_step_without_profiler_ms=2.0)
    assert roofline_report(c, B, T, profile=profile, ceilings=H200_CEILINGS)["floor_ms"] == pytest.approx(
        sum(r["floor_ms"] for r in at_h200.values()), rel=1e-12)                           # an explicit argument wins

@pytest.mark.parametrize("name", ["rb100m", "prof183m"])
def test_recorded_profiles_are_classified(name):
    "Under 5% of the recorded kernel time is left in 'other'; every family of the floor that has kernels is found."
    profile = load_results(f"profile_{name}")
    measured = measured_families(profile)
    kernel_sum = next(r["ms"] for r in profile["rows"] if r.get("name", r.get("row")).startswith("all "))
    assert sum(measured.values()) == pytest.approx(kernel_sum, rel=1e-9)
    assert measured["other"] < 0.05 * kernel_sum, measured
    assert all(measured[f] > 0 for f in ("GEMM", "attention", "norms and pointwise", "optimizer"))
    assert measured["MoE routing"] == 0               # dense models

def test_kernel_family_names():
    cases = {"forward.nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "GEMM", "backward.matmul_kernel": "GEMM",
             "backward.void cublasLt::splitKreduce_kernel<32, 16, int>": "GEMM", "forward.grouped_gemm_kernel": "GEMM",
             "backward.flash_backward_dkdv_kernel": "attention", "forward.hopper_forward_kernel": "attention",
             "forward.rms_norm_forward_kernel": "norms and pointwise", "forward.cross_entropy_rows_kernel": "norms and pointwise",
             "backward.void at::native::vectorized_elementwise_kernel<4>": "norms and pointwise",
             "forward.router_rowdot_kernel": "MoE routing", "backward.combine_rows_kernel": "MoE routing",
             "forward.gather_rows_kernel": "MoE routing", "backward.routed_swiglu_backward_kernel": "norms and pointwise",
             "optimizer.adamw_multi_tensor_kernel": "optimizer", "optimizer.Memcpy HtoD (Pinned -> Device)": "optimizer",
             "other.Memcpy HtoD (Pinned -> Device)": "other", "forward.some_new_kernel": "other", "adamw_multi_tensor_kernel": "optimizer",
             "graph.nvjet_sm90_tst_128x256": "GEMM", "graph.adamw_multi_tensor_kernel": "optimizer", "graph.Memcpy DtoH (Device -> Pageable)": "other"}
    assert {n: kernel_family(n) for n in cases} == cases

def test_report_sums():
    "Families add to the floor and to the kernel sum; family gaps + launch gaps + remainder = step - floor."
    profile = {"rows": [{"name": "forward.nvjet_x", "ms": 3.0}, {"name": "backward.flash_backward_dq_kernel", "ms": 1.5},
                        {"name": "backward.rms_norm_backward_kernel", "ms": 0.5}, {"name": "optimizer.adamw_multi_tensor_kernel", "ms": 0.25},
                        {"name": "other.Memcpy DtoH (Device -> Pageable)", "ms": 0.125}],
               "kernel_sum_ms": 5.375, "unprofiled_step_ms": 7.0, "device_idle_ms": 1.0}
    report = roofline_report(model_config("tiny"), 2, 16, profile)
    rows, m = report["families"], report["measured"]
    assert [r["family"] for r in rows] == list(ROOFLINE_FAMILIES)
    assert sum(r["floor_ms"] for r in rows) == pytest.approx(report["floor_ms"])
    assert report["floor_ms"] == pytest.approx(sum(k["floor_ms"] for k in step_kernels(model_config("tiny"), 2, 16)))
    assert {r["family"]: r["measured_ms"] for r in rows} == {"GEMM": 3.0, "attention": 1.5, "norms and pointwise": 0.5,
                                                             "MoE routing": 0.0, "optimizer": 0.25, "other": 0.125}
    assert m["launch_gaps_ms"] == 1.0 and m["remainder_ms"] == pytest.approx(7.0 - 5.375 - 1.0)
    assert sum(r["gap_ms"] for r in rows) + m["launch_gaps_ms"] + m["remainder_ms"] == pytest.approx(m["step_ms"] - report["floor_ms"])
    assert roofline_report(model_config("tiny"), 2, 16)["measured"] is None

def test_report_of_a_live_cpu_profile():
    "The report reads `profile_step`'s own dict too (the form `rtrainer profile` saves it from)."
    trainer = profile_trainer("tiny", batch_size=2, seq_len=16, vocab_size=512)
    live = profile_step(trainer)
    report = roofline_report(trainer.model.config, 2, 16, live)
    assert sum(r["measured_ms"] for r in report["families"]) == pytest.approx(live["kernel_sum_ms"])
    assert report["measured"]["step_ms"] == live["unprofiled_step_ms"]

def test_recorded_roofline_matches_the_code():
    "data/results/roofline.json holds the four configurations; its floors are what the code computes, measured only where profiled."
    recorded = load_results("roofline")
    fresh = {r["config"]: r for r in roofline_suite(save=False)}
    assert [r["config"] for r in recorded["rows"]] == list(REFERENCE_BATCH)
    for row in recorded["rows"]:
        assert row["floor_ms"] == pytest.approx(fresh[row["config"]]["floor_ms"], rel=1e-12)
        profiled = load_results(f"profile_{row['config']}") is not None      # all four are recorded now
        assert (row["measured"] is not None) == profiled
        if profiled:
            source = load_results(f"profile_{row['config']}")
            assert row["measured"]["profile"]["commit"] == source["commit"] and row["measured"]["profile"]["date"] == source["date"]
            assert row["measured"]["step_ms"] == source["full_step_without_profiler_ms"]
        else: assert row["note"] == "not profiled on the GPU yet"
    json.dumps(recorded)

def test_recorded_graph_roofline_matches_the_code():
    "data/results/roofline_graph.json: the floors the code computes at each profile_graph_CONFIG's ceilings, its measured step that profile's."
    recorded = load_results("roofline_graph")
    fresh = {r["config"]: r for r in roofline_suite(save=False, graph=True)}
    assert [r["config"] for r in recorded["rows"]] == list(REFERENCE_BATCH)
    for row in recorded["rows"]:
        source = load_results(f"profile_graph_{row['config']}")
        assert row["floor_ms"] == pytest.approx(fresh[row["config"]]["floor_ms"], rel=1e-12)
        assert row["measured"]["profile"]["commit"] == source["commit"] and row["measured"]["step_ms"] == source["full_step_without_profiler_ms"]
        assert "(sustained)" in row["ceilings"]["source"] and row["ceilings"] == source["ceilings"]

def _fake_gpu_profile(tmp_path, monkeypatch, measure, flags=()):
    """Run `rtrainer profile` as on a GPU: the GPU's report faked from a CPU one, `measure` standing in for measure_ceilings;
    returns (report, what save_results was given)."""
    import rtrainer.profiling as profiling
    from rtrainer.cli import main
    trainer = profile_trainer("tiny", batch_size=2, seq_len=16, vocab_size=512)
    report = dict(profile_step(trainer), device="cuda", device_idle_ms=0.5, largest_gaps=[], config="tiny", batch_size=2, seq_len=16)
    saved = {}
    monkeypatch.setattr(profiling, "_profile_report", lambda args: report)
    monkeypatch.setattr(profiling, "measure_ceilings", measure)
    monkeypatch.setattr(profiling, "save_results", lambda name, rows, **extra: saved.update(extra, name=name, rows=rows) or tmp_path / name)
    assert main(["profile", "--config", "tiny", "--vocab-size", "512", "--out", str(tmp_path / "p.json"), *flags]) == 0
    return report, saved

def test_profile_command_records_the_roofline(tmp_path, monkeypatch):
    "On a GPU `rtrainer profile` records the roofline report, at the ceilings it measured once, beside the rows."
    ceilings = dict(gemm_tflops=500.0, copy_GBps=3000.0, source="made up")
    calls = []
    report, saved = _fake_gpu_profile(tmp_path, monkeypatch, lambda device, sustained: calls.append((device, sustained)) or ceilings)
    assert calls == [("cuda", False)] and json.loads((tmp_path / "p.json").read_text())["ceilings"] == ceilings
    roofline = saved["roofline"]
    assert saved["name"] == "profile_tiny" and roofline["measured"]["launch_gaps_ms"] == 0.5
    assert saved["ceilings"] == roofline["ceilings"] == ceilings
    assert roofline["floor_ms"] == pytest.approx(roofline_report(model_config("tiny", vocab_size=512), 2, 16, ceilings=ceilings)["floor_ms"])
    assert roofline["floor_ms"] > roofline_report(model_config("tiny", vocab_size=512), 2, 16)["floor_ms"]   # slower than the H200's

def test_graph_profile_records_apart_at_sustained_ceilings(tmp_path, monkeypatch):
    "`profile --cuda-graph` measures the ceilings back to back and records profile_graph_CONFIG, leaving profile_CONFIG alone."
    ceilings = dict(gemm_tflops=600.0, copy_GBps=3000.0, source="made up")
    calls = []
    _, saved = _fake_gpu_profile(tmp_path, monkeypatch, lambda device, sustained: calls.append((device, sustained)) or ceilings,
                                 flags=["--cuda-graph"])
    assert calls == [("cuda", True)] and saved["name"] == "profile_graph_tiny" and saved["roofline"]["ceilings"] == ceilings

def test_profile_default_report_paths(tmp_path, monkeypatch):
    "Without --out the report goes to runs/profile-CONFIG.json, or runs/profile-graph-CONFIG.json with --cuda-graph."
    import rtrainer.profiling as profiling
    from rtrainer.cli import main
    monkeypatch.chdir(tmp_path)
    report = dict(profile_step(profile_trainer("tiny", batch_size=2, seq_len=16, vocab_size=512)), config="tiny", batch_size=2, seq_len=16)
    monkeypatch.setattr(profiling, "_profile_report", lambda args: report)
    for flags, path in [([], "runs/profile-tiny_moe.json"), (["--cuda-graph"], "runs/profile-graph-tiny_moe.json")]:
        assert main(["profile", "--config", "tiny_moe", *flags]) == 0
        assert (tmp_path / path).exists() and (tmp_path / path).with_suffix(".png").exists(), path

def test_profile_keeps_the_profile_when_the_ceilings_run_out_of_memory(tmp_path, monkeypatch, capsys):
    "Out of memory while measuring the ceilings: one line on stderr, the rows recorded, the roofline at the H200's ceilings."
    def out_of_memory(device, sustained): raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    report, saved = _fake_gpu_profile(tmp_path, monkeypatch, out_of_memory)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ran out of memory" in err[0], err
    assert saved["ceilings"] is None and saved["roofline"]["ceilings"] == H200_CEILINGS
    assert json.loads((tmp_path / "p.json").read_text())["ceilings"] is None
    assert any(r["name"] == "full step" for r in saved["rows"]) and len(saved["rows"]) > 3
