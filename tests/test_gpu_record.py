"""The GPU test record that main carries (data/results/gpu_tests.json, written by `bash tests/gpu_suite.sh gpu-tests`
on the GPU machine) is green, complete, and made from the code that runs on the GPU now: a change to `rtrainer/` or to
a GPU test after the recorded commit needs a new record."""
import json, shutil, subprocess
from pathlib import Path
import pytest
from gpu_tests import green   # the record's own verdict (tests/gpu_tests.py)

ROOT = Path(__file__).resolve().parent.parent
RECORD = json.loads((ROOT / "data" / "results" / "gpu_tests.json").read_text())
GPU_CODE = ["rtrainer", ":(glob)tests/*_gpu.py"]   # what the record vouches for

def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

def test_record_is_green_and_complete():
    assert green(RECORD), (f"the GPU record at {RECORD['commit']} is not green: {RECORD['passed']} passed, failures "
                           f"{[f['test'] for f in RECORD['failures']]}, stopped phases {RECORD['incomplete_phases']}")

def test_gpu_code_is_the_recorded_code():
    if shutil.which("git") is None or not (ROOT / ".git").exists(): pytest.skip("not a git checkout")
    commit = RECORD["commit"]
    if git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        pytest.skip(f"the recorded commit {commit} is not in this clone's history")
    changed = git("diff", "--name-only", commit, "--", *GPU_CODE).stdout.split()
    assert not changed, (f"changed since the GPU record at {commit}: {', '.join(changed)}; run `bash tests/gpu_suite.sh "
                         "gpu-tests` on the GPU machine and commit data/results/gpu_tests.json")
