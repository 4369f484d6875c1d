"""Running a chapter never modifies a tracked file: a cell that measures writes data/results/ only when
RTRAINER_RECORD=1 is set. Checked by running 00_tokenization's benchmark cell with the benchmark stubbed out (nothing
heavy runs), and by reading the measuring cells of the optimizer, profiling, distributed and command-line chapters."""
import json, re
from pathlib import Path
import pytest
CaptureShell = pytest.importorskip("execnb.shell", reason="needs nbdev's execnb (the dev extra)").CaptureShell

ROOT = Path(__file__).resolve().parent.parent
RECORDERS = re.compile(r"\b(benchmark_suite|scaling_suite|loss_curve_suite|versus|benchmark_prepare_speed|startup_times|save_results)\(|\[\"profile\"")

def code_cells(name):
    "The non-export code cells of nbs/NAME.ipynb, as source strings."
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and not "".join(c["source"]).startswith("#| export")]

def benchmark_cell():
    cells = [s for s in code_cells("00_tokenization") if "benchmark_prepare_speed(" in s]
    assert len(cells) == 1, cells
    return cells[0]

@pytest.mark.parametrize("record", [None, "1"])
def test_tokenization_benchmark_records_only_when_asked(record, monkeypatch):
    if record: monkeypatch.setenv("RTRAINER_RECORD", record)
    else: monkeypatch.delenv("RTRAINER_RECORD", raising=False)
    shell = CaptureShell()
    setup = ("import os\nfrom pathlib import Path\n"
             f"ROOT = Path({str(ROOT)!r})\ncalls = []\n"
             "def benchmark_prepare_speed(**kwargs): calls.append(kwargs); return {}")   # the stub: nothing is measured
    for code in (setup, benchmark_cell()):
        outputs = shell.run(code)
        assert not [o for o in outputs if o.get("output_type") == "error"], outputs
    calls = shell.user_ns["calls"]
    assert len(calls) == 1
    expected = ROOT / "data/results/tokenization_speed.json" if record else None
    assert calls[0]["out_path"] == expected

@pytest.mark.parametrize("name", ["00_tokenization", "04_optimizer", "07_profiling", "08_distributed", "08b_expert_parallel", "09_cli"])
def test_recording_cells_are_gated(name):
    "Every measuring cell (`#| cuda` or `#| slow`) of these chapters that can record asks RTRAINER_RECORD first."
    measuring = [code for code in code_cells(name) if code.startswith(("#| cuda", "#| slow")) and RECORDERS.search(code)]
    assert measuring, f"{name}: no measuring cell found"
    for code in measuring: assert 'os.environ.get("RTRAINER_RECORD") == "1"' in code, code[:400]
