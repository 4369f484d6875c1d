"Profiling chapter on the GPU (run with -m cuda): kernel attribution of a real step, and one cheap versus round."
import json, math
import pytest
import torch
from rtrainer.profiling import PHASES, profile_trainer, profile_step, versus, run_arm

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_profile_attributes_kernels_to_phases(impl):
    trainer = profile_trainer("tiny", batch_size=8, seq_len=128, impl=impl)
    report = profile_step(trainer)
    names = {r["name"].split(".")[0] for r in report["rows"]}
    print({k: round(v, 3) for k, v in report["phases_ms"].items()}, "all kernels", round(report["kernel_sum_ms"], 3),
          "full step", round(report["full_step_ms"], 3), "other", [r["name"] for r in report["rows"] if r["name"].startswith("other.")][:5])
    assert set(PHASES) <= names, names
    assert all(report["phases_ms"][p] > 0 for p in PHASES)
    assert 0 < report["kernel_sum_ms"] <= report["full_step_ms"]
    other = sum(r["ms"] for r in report["rows"] if r["name"].startswith("other."))
    assert other < 0.2 * report["kernel_sum_ms"], f"{other:.3f} ms of kernels outside every phase"

def test_profile_command_measures_this_gpu(tmp_path, monkeypatch):
    """`rtrainer profile` end to end: the report and the record carry the ceilings measure_ceilings read on this GPU,
    between a tenth of and the datasheet (dense bf16 under 1000 TFLOP/s, HBM under 5 TB/s read + written), and the
    roofline at them lies under the measured step."""
    import rtrainer.profiling as profiling
    from rtrainer.cli import main
    saved = {}
    monkeypatch.setattr(profiling, "save_results", lambda name, rows, **extra: saved.update(extra, name=name) or tmp_path / name)
    assert main(["profile", "--config", "tiny", "--batch-size", "8", "--seq-len", "128", "--out", str(tmp_path / "p.json")]) == 0
    ceilings = json.loads((tmp_path / "p.json").read_text())["ceilings"]
    print(ceilings, saved["roofline"]["floor_ms"], saved["roofline"]["measured"])
    assert 100 < ceilings["gemm_tflops"] < 1000 and 500 < ceilings["copy_GBps"] < 10_000, ceilings
    assert torch.cuda.get_device_name() in ceilings["source"] and saved["ceilings"] == saved["roofline"]["ceilings"] == ceilings
    assert 0 < saved["roofline"]["floor_ms"] < saved["roofline"]["measured"]["step_ms"]

def test_graph_profile_is_the_replayed_step(tmp_path, monkeypatch):
    """`rtrainer profile --cuda-graph`: the step replayed as one CUDA graph, profiled over 10 steps back to back. Every row is
    a kernel of the graph, a whole number of calls a step (each replay runs the same kernels); its GEMMs, attention and
    optimizer kernels are found; the kernels and the idle time between them fit in the step; the ceilings were measured
    back to back; the record is profile_graph_tiny."""
    import rtrainer.profiling as profiling
    from rtrainer.cli import main
    from rtrainer.profiling import GRAPH_PROFILE_STEPS, kernel_family
    saved = {}
    monkeypatch.setattr(profiling, "save_results", lambda name, rows, **extra: saved.update(extra, name=name) or tmp_path / name)
    assert main(["profile", "--config", "tiny", "--cuda-graph", "--batch-size", "8", "--seq-len", "128", "--out", str(tmp_path / "g.json")]) == 0
    report = json.loads((tmp_path / "g.json").read_text())
    print({k: report[k] for k in ("full_step_ms", "unprofiled_step_ms", "kernel_sum_ms", "device_idle_ms")}, report["ceilings"], report["rows"][:3])
    assert report["steps"] == GRAPH_PROFILE_STEPS and report["phases_ms"] == {} and math.isfinite(report["loss"])
    assert all(r["name"].startswith("graph.") and isinstance(r["calls"], int) and r["calls"] >= 1 for r in report["rows"])
    families = {kernel_family(r["name"]) for r in report["rows"]}
    assert {"GEMM", "attention", "optimizer", "norms and pointwise"} <= families, families
    assert 0 < report["kernel_sum_ms"] and report["device_idle_ms"] >= 0 and all(g["phase"] == "graph" for g in report["largest_gaps"])
    assert report["kernel_sum_ms"] + report["device_idle_ms"] <= 1.02 * report["full_step_ms"]
    assert "(sustained)" in report["ceilings"]["source"] and 100 < report["ceilings"]["gemm_tflops"] < 1000
    assert saved["name"] == "profile_graph_tiny" and saved["roofline"]["measured"]["step_ms"] == report["unprofiled_step_ms"]

def test_baseline_arms_run_and_record_graphs():
    spec = dict(config="tiny", batch_size=8, seq_len=128, warmup=3, steps=3)
    eager = run_arm(dict(spec, arm="eager"))
    print(eager)
    assert eager["tokens_per_s"] > 0 and eager["census"]["params"].get("bfloat16") and set(eager["census"]["moments"]) == {"float32"}

def test_versus_one_round_in_processes():
    rows, raw = versus("tiny", tiers=("default", "reduce-overhead"), rounds=2, steps=3, warmup=3, batch_size=8, seq_len=128, save=False)
    by = {r["arm"]: r for r in rows}
    assert all(r.get("tokens_per_s") for r in rows), [(r["arm"], r.get("status")) for r in rows]
    assert by["rtrainer"]["tokens_per_s"] > 0 and by["default"]["tokens_per_s"] > 0 and math.isfinite(by["default"]["rtrainer/arm"])
    assert by["default"]["cuda_graphs"] == 0 and by["reduce-overhead"]["cuda_graphs"] > 0, (by["default"], by["reduce-overhead"])
