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
    assert main(["bench", "gemm", "--model-shapes", "rb100m"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err

def test_every_flag_of_every_subcommand_has_help():
    "`rtrainer COMMAND --help` says what each flag does."
    import argparse
    from rtrainer.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = {name: [a.option_strings[-1] if a.option_strings else a.dest for a in p._actions if not a.help]
              for name, p in sub.choices.items()}
    assert not any(silent.values()), {k: v for k, v in silent.items() if v}


def test_parsing_any_command_imports_neither_torch_nor_triton():
    "Every command's typical arguments parse, in a fresh process, without importing torch or triton (so --help is quick)."
    typical = [["prepare", "--source", "jsonl", "--input", "a.jsonl", "--out", "d"], ["train"], ["train", "tiny", "--steps", "5", "--nproc", "2"],
               ["train", "--config", "run.toml", "--no-progress"], ["eval", "--checkpoint", "c", "--data", "d"],
               ["generate", "--checkpoint", "c", "--prompt", "The"], ["export", "c", "out.safetensors", "--dtype", "bf16"],
               ["doctor"], ["bench", "rms_norm"], ["sweep", "rms_norm", "BLOCK_ROWS=1,BLOCK_ROWS=2"], ["profile", "--config", "tiny"],
               ["ab", "--ref", "HEAD"], ["versus", "--config", "tiny"], ["sweep-arch", "tiny"], ["init", "tiny", "--seed", "1", "--d-model", "32"]]
    names = {argv[0] for argv in typical}
    assert names == set(build_parser()._subparsers._group_actions[0].choices)   # every command is covered
    code = ("import json, sys; from rtrainer.cli import build_parser; p = build_parser()\n"
            f"for argv in {typical!r}: p.parse_args(argv)\n"
            "print(json.dumps(sorted(m for m in ('torch', 'triton') if m in sys.modules)))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []



def test_startup_times_records_the_machine_as_every_record_does(tmp_path, monkeypatch):
    "cli_startup.json's device and cpu are machine_metadata's, not overridden by the command line chapter."
    from rtrainer import kernels
    from rtrainer.cli import startup_times
    monkeypatch.setattr(kernels, "RESULTS_DIR", tmp_path)
    rows = startup_times(repeats=1, names=["python (empty program)"], note="test")
    saved = json.loads((tmp_path / "cli_startup.json").read_text())
    machine = kernels.machine_metadata()
    assert (saved["device"], saved["cpu"]) == (machine["device"], machine["cpu"]) and saved["rows"] == rows


@pytest.mark.parametrize("flags, says", [
    (["--steps", "-1"], "--steps must be positive, got -1"),
    (["--lr", "-1"], "--lr must be positive (or 0 for the model's default), got -1.0"),
    (["--cuda-graph", "--no-cuda-graph"], "--cuda-graph and --no-cuda-graph contradict each other: give one"),
    (["--config", "RUN_FILE"], "--warmup must be >= 0, got -3")])
def test_a_bad_setting_is_refused_before_torch_is_imported(tmp_path, flags, says):
    "What TrainConfig.validate refuses, from a flag or a run file, is one line and exit 2 from a process that never imported torch."
    run = tmp_path / "run.toml"; run.write_text("warmup = -3\n")
    argv = ["train", *[str(run) if f == "RUN_FILE" else f for f in flags], "--out-dir", str(tmp_path / "o")]
    code = ("import sys\nfrom rtrainer.cli import main\n"
            f"try: status = main({argv!r})\n"
            "finally: print('torch imported:', 'torch' in sys.modules)\n"
            "sys.exit(status)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == f"rtrainer train: error: {says}", r.stderr
    assert r.stdout.strip() == "torch imported: False" and not (tmp_path / "o").exists()

def test_bare_rtrainer_prints_its_commands():
    r = subprocess.run(RTRAINER, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "prepare" in r.stdout and "generate" in r.stdout and "COMMAND --help" in r.stdout


def test_kernel_commands_without_a_gpu_are_one_line_exit_2():
    "bench and sweep on a CPU without TRITON_INTERPRET: one line saying what they need, status 2 (a user error)."
    import os, torch
    if torch.cuda.is_available(): pytest.skip("checks the no-GPU message")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for argv in (["bench", "rms_norm"], ["sweep", "vecadd", "BLOCK=256"]):
        r = subprocess.run([*RTRAINER, *argv], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "TRITON_INTERPRET=1" in r.stderr, r.stderr


def test_profile_refuses_a_gpu_sized_model_on_a_cpu(capsys):
    "`rtrainer profile --config prof183m` on a CPU: one line before anything is allocated (it grew past 10 GB)."
    import torch
    if torch.cuda.is_available(): pytest.skip("checks the no-GPU message")
    assert main(["profile", "--config", "prof183m"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
