"The rtrainer command: dispatch, python -m, the multi-process launch, and its errors."
import json, subprocess, sys
import pytest
from rtrainer.cli import main, build_parser
import processes

RTRAINER = [sys.executable, "-m", "rtrainer"]


def test_every_subcommand_is_available():
    names = set(build_parser()._subparsers._group_actions[0].choices)
    assert {"prepare", "init", "train", "eval", "generate", "doctor", "bench", "sweep", "profile", "ab", "versus", "sweep-arch"} <= names


def test_python_dash_m_and_unknown_command():
    r = subprocess.run([*RTRAINER, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "prepare" in r.stdout
    r = subprocess.run([*RTRAINER, "fly"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_nproc_must_be_positive(capsys):
    assert main(["train", "--nproc", "0", "--data", "synthetic"]) == 2
    assert "--nproc must be at least 1" in capsys.readouterr().err


def test_train_on_two_processes_through_torchrun(tmp_path):
    out = tmp_path / "np2"
    r = processes.run([*RTRAINER, "train", "--nproc", "2", "--data", "synthetic", "--steps", "2", "--log-every", "1",
                        "--batch-size", "2", "--seq-len", "16", "--vocab-size", "512", "--device", "cpu", "--no-progress",
                        "--no-checkpoints", "--out-dir", str(out)], timeout=300)   # its torchrun workers end with it
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["world_size"] for row in rows if "loss" in row] == [2, 2]


def test_bench_gemm_is_wired_and_needs_a_gpu(capsys):
    import torch
    if torch.cuda.is_available(): pytest.skip("checks the no-GPU message")
    assert main(["bench", "gemm", "--model-shapes", "rb100m"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err

def test_every_flag_of_every_subcommand_has_help():
    "`rtrainer COMMAND --help` says what each flag does."
    import argparse
    from rtrainer.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = {name: [a.option_strings[-1] if a.option_strings else a.dest for a in p._actions if not a.help]
              for name, p in sub.choices.items()}
    assert not any(silent.values()), {k: v for k, v in silent.items() if v}
