"""Render the chapters into a browsable site (`make docs`), and README.md from nbs/index.ipynb (`make readme`).

The site: nbdev's docs processing of nbs/ into _proc/ (`skip_procs` in pyproject.toml keeps nbdev from executing
any cell), then Quarto where it is installed (nbdev's pipeline), else nbconvert's HTML pages. No notebook is
executed: the pages show the outputs stored in the notebooks, the figures among them.
    python tools/build_docs.py [--out _docs]      python tools/build_docs.py --readme"""
import argparse, os, re, shutil, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def nbconvert_env():
    "The environment for nbconvert, with its templates on JUPYTER_PATH wherever nbconvert is installed."
    import nbconvert
    share = Path(nbconvert.__file__).resolve().parents[4] / "share" / "jupyter"   # site-packages/../../../share/jupyter
    return dict(os.environ, JUPYTER_PATH=os.pathsep.join(filter(None, [os.environ.get("JUPYTER_PATH"), str(share)])))

def process_notebooks():
    "nbdev's docs processing: nbs/*.ipynb (not those starting with _) into _proc/, with the Quarto project files."
    from nbdev.quarto import refresh_quarto_yml
    from nbdev.serve import proc_nbs
    os.chdir(ROOT)
    refresh_quarto_yml()
    return Path(proc_nbs(n_workers=0))

def render_with_quarto(proc, out):
    subprocess.run(["quarto", "render", "--no-execute"], cwd=proc, check=True)
    shutil.move(str(proc / "_docs"), str(out))

def render_with_nbconvert(proc, out):
    pages = sorted(proc.glob("*.ipynb"))
    r = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output-dir", str(out), *map(str, pages)],
                       env=nbconvert_env(), capture_output=True, text=True)
    if r.returncode: sys.exit(f"nbconvert failed:\n{r.stderr[-3000:]}")
    for page in out.glob("*.html"):      # links between chapters point at the pages, not the notebooks
        page.write_text(re.sub(r'href="(?:nbs/)?([\w-]+)\.ipynb', r'href="\1.html', page.read_text()))

def build_site(out):
    out = Path(out).resolve()
    proc = process_notebooks()
    shutil.rmtree(out, ignore_errors=True)
    if shutil.which("quarto"): render_with_quarto(proc, out)
    else:
        print("quarto not found: rendering with nbconvert")
        render_with_nbconvert(proc, out)
    (out / "data" / "results").mkdir(parents=True, exist_ok=True)
    for png in (ROOT / "data" / "results").glob("*.png"): shutil.copy(png, out / "data" / "results" / png.name)   # the README's images
    print(f"site: {out / 'index.html'}")

def build_readme():
    "README.md from nbs/index.ipynb: its markdown and the outputs it stores (the results table), without the code."
    r = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "markdown", "--no-input", str(ROOT / "nbs" / "index.ipynb"),
                        "--output-dir", str(ROOT), "--output", "README"], env=nbconvert_env(), capture_output=True, text=True)
    if r.returncode: sys.exit(f"nbconvert failed:\n{r.stderr[-3000:]}")
    print(f"README.md: {len((ROOT / 'README.md').read_text()):,} characters")

if __name__ == "__main__":
    p = argparse.ArgumentParser(description="Render the docs site, or README.md with --readme.")
    p.add_argument("--out", default=str(ROOT / "_docs"), help="the site's folder (default: _docs)")
    p.add_argument("--readme", action="store_true", help="make README.md from nbs/index.ipynb instead")
    a = p.parse_args()
    build_readme() if a.readme else build_site(a.out)
