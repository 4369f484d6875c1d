"The measuring protocol (nbs/measuring.ipynb) states numbers the code also holds: they must agree."
import json, re
from pathlib import Path
from rtrainer.model import model_config, parameter_counts, REFERENCE_BATCH
from rtrainer.training import DATASHEET_PEAK_TFLOPS
from rtrainer.kernels import COPY_CEILING_GBPS

ROOT = Path(__file__).resolve().parent.parent
TEXT = "\n".join("".join(c["source"]) for c in json.loads((ROOT / "nbs" / "measuring.ipynb").read_text())["cells"])

def reference_table():
    "Rows of the reference-configuration table, as lists of cells, by config name."
    rows = {}
    for line in TEXT.splitlines():
        m = re.match(r"\| `(\w+)` \|", line)
        if m: rows[m.group(1)] = [c.strip() for c in line.strip("|").split("|")]
    return rows

def test_reference_configurations_match_the_presets():
    rows = reference_table()
    assert sorted(rows) == sorted(REFERENCE_BATCH)
    for name, cells in rows.items():
        c = model_config(name)
        assert cells[1] == f"{c.vocab_size} / {c.padded_vocab_size}", name
        assert cells[2:4] == [str(c.d_model), str(c.n_layers)], name
        assert cells[4] == f"{c.n_heads} / {c.n_kv_heads} / {c.head_dim}", name
        assert cells[5].split()[0] == str(c.expert_d_ff if c.n_experts else c.d_ff), name
        assert cells[6] == (f"{c.n_experts} (top-{c.top_k})" if c.n_experts else "dense"), name
        assert cells[7] == str(REFERENCE_BATCH[name]), name
    assert f"{parameter_counts(model_config('moe4b'))['total']:,}" in rows["moe4b"][8]

def test_peaks_and_ceilings_match_the_code():
    for gpu, peak in DATASHEET_PEAK_TFLOPS.items():
        assert f"{peak:g}" in TEXT, gpu
    assert f"{COPY_CEILING_GBPS / 1000:.2f} TB/s" in TEXT
