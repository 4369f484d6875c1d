"`make docs` (tools/build_docs.py) renders every chapter into a page, with every figure the chapter stores, executing nothing."
import base64, hashlib, json, re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def stored_figures(notebook):
    "The PNG outputs a notebook stores, as digests of their bytes."
    cells = json.loads(notebook.read_text())["cells"]
    return [hashlib.sha256(base64.b64decode(o["data"]["image/png"])).hexdigest()
            for c in cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]

def shown_figures(page):
    "Digests of the PNG images a rendered page shows: embedded (nbconvert) or beside it (Quarto)."
    digests = []
    for src in re.findall(r'<img[^>]+src="([^"]+)"', page.read_text()):
        if src.startswith("data:image/png;base64,"): data = base64.b64decode(src.split(",", 1)[1])
        elif src.endswith(".png") and (page.parent / src).exists(): data = (page.parent / src).read_bytes()
        else: continue
        digests.append(hashlib.sha256(data).hexdigest())
    return digests

def test_every_chapter_and_figure_is_in_the_site(tmp_path):
    out = tmp_path / "site"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "build_docs.py"), "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    chapters = [p for p in sorted((ROOT / "nbs").glob("*.ipynb")) if not p.name.startswith("_")]
    assert len(chapters) > 10
    for nb in chapters:
        page = out / f"{nb.stem}.html"
        assert page.exists(), f"{nb.name}: no page {page.name}"
        missing = set(stored_figures(nb)) - set(shown_figures(page))
        assert not missing, f"{page.name}: {len(missing)} of the notebook's figures are not shown"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", (ROOT / "nbs" / "index.ipynb").read_text()):   # the front page's image links
        assert (out / image).exists(), image

def test_readme_is_the_front_page_with_its_stored_outputs():
    "README.md is made from nbs/index.ipynb (make readme): short, and it carries the outputs the notebook stores (the results table)."
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 8000, len(readme)
    cells = json.loads((ROOT / "nbs" / "index.ipynb").read_text())["cells"]
    outputs = ["".join(o["data"]["text/markdown"]) for c in cells for o in c.get("outputs", []) if "text/markdown" in o.get("data", {})]
    assert len(outputs) >= 2, "the results table and the GPU test record must be stored in nbs/index.ipynb"
    for text in outputs: assert text.strip() in readme, f"not in README.md (run make readme): {text[:200]}"
    table = next(t for t in outputs if t.lstrip().startswith("|"))
    assert len([l for l in table.splitlines() if l.startswith("| ")]) - 1 <= 8, "at most 8 rows in the results table"
