"data/results/README.md lists every recorded result, what made it and the chapter that shows it; the three must agree."
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "data" / "results"

def index_rows():
    "{file: (made by, chapter)} from the table of data/results/README.md."
    rows = {}
    for line in (RESULTS / "README.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| (.+) \| (.+) \|$", line)
        if m: rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows

def notebook_source(name):
    cells = json.loads((ROOT / "nbs" / f"{name}.ipynb").read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells)

def test_every_result_is_listed_and_every_listed_file_exists():
    listed = set(index_rows())
    present = {p.name for p in RESULTS.iterdir() if p.name != "README.md"}
    assert present - listed == set(), f"not in data/results/README.md: {sorted(present - listed)}"
    assert listed - present == set(), f"listed but missing: {sorted(listed - present)}"

def test_each_chapter_named_reads_its_file():
    for name, (made_by, chapter) in index_rows().items():
        assert made_by, name
        m = re.fullmatch(r"`([0-9a-z_]+)`", chapter)
        assert m, f"{name}: the chapter must be one notebook name in backquotes, got {chapter!r}"
        stem = name.rsplit(".", 1)[0]
        assert re.search(rf"(?<![\w]){re.escape(stem)}(?![\w])", notebook_source(m.group(1))), f"{name}: not read by nbs/{m.group(1)}.ipynb"
