"Settings chapter: a run described by a file (--config run.toml), the file every run writes, and flags over the file."
import argparse, json
import pytest
from rtrainer.cli import main

SMALL = ["--data", "synthetic", "--steps", "6", "--batch-size", "2", "--seq-len", "16", "--vocab-size", "512", "--log-every", "2",
         "--eval-every", "0", "--device", "cpu", "--no-progress"]


def cli(*args): return main([str(a) for a in args])


def losses(folder): return [r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_run_repeated_from_its_written_config(tmp_path):
    "Every run writes OUT_DIR/config.toml; `rtrainer train --config` that file repeats the run: the same losses."
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli("train", "tiny_moe", *SMALL, "--d-model", "32", "--lr", "2e-3", "--out-dir", first) == 0
    written = (first / "config.toml").read_text()
    assert 'model = "tiny_moe"' in written and "d_model = 32" in written and "lr = 0.002" in written
    assert cli("train", "--config", first / "config.toml", "--out-dir", second) == 0
    assert len(losses(first)) == 3 and losses(second) == losses(first)
    assert (second / "config.toml").read_text().splitlines()[2:] == written.splitlines()[2:]   # all but the folder comments


def test_flags_override_the_file(tmp_path):
    run = tmp_path / "run.toml"
    run.write_text('steps = 4\nseq_len = 16\nbatch_size = 2\nvocab_size = 512\ndata = "synthetic"\ndevice = "cpu"\nprogress = false\n'
                   'eval_every = 0\nlog_every = 2\nbetas = [0.8, 0.9]\n')
    assert cli("train", "--config", run, "--steps", "2", "--out-dir", tmp_path / "o") == 0
    assert len(losses(tmp_path / "o")) == 1                          # --steps 2 (log every 2), not the file's 4
    written = (tmp_path / "o" / "config.toml").read_text()
    assert "steps = 2" in written and "betas = [0.8, 0.9]" in written and "vocab_size = 512" in written


def test_a_bad_run_file_is_one_line_naming_key_and_file(tmp_path, capsys):
    run = tmp_path / "run.toml"
    for text, says in [("stpes = 4\n", "unknown setting 'stpes'"), ('steps = "four"\n', "steps must be an integer"),
                       ("steps = \n", "not a TOML run file"), ('dp = "zero"\n', "dp must be one of fsdp, ddp")]:
        run.write_text(text)
        assert cli("train", "--config", run, "--out-dir", tmp_path / "o") == 2
        err = capsys.readouterr().err
        assert says in err and str(run) in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()                              # refused before anything is written
    assert cli("train", "--config", "prof183m") == 2                 # a preset is not a run file: say how to name one
    assert "rtrainer train prof183m" in capsys.readouterr().err


def test_a_run_file_takes_the_memory_budget(tmp_path, capsys):
    "--memory-budget is a flag and a run-file key like any setting; on a CPU a run file asking for it is refused in one line."
    import argparse
    from rtrainer.settings import add_train_arguments, read_run_file
    p = argparse.ArgumentParser(); add_train_arguments(p)
    assert "--memory-budget" in p.format_help() and p.parse_args(["--memory-budget", "40"]).memory_budget == 40.0
    run = tmp_path / "run.toml"
    run.write_text('memory_budget = 40\ndata = "synthetic"\ndevice = "cpu"\n')
    assert read_run_file(run)["memory_budget"] == 40
    assert cli("train", "--config", run, "--out-dir", tmp_path / "o") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--memory-budget measures a GPU's peak memory; this run is on cpu" in err[0], err
    assert not (tmp_path / "o").exists()
    run.write_text('memory_budget = "lots"\n')
    assert cli("train", "--config", run, "--out-dir", tmp_path / "o") == 2 and "memory_budget must be a number" in capsys.readouterr().err


@pytest.mark.parametrize("argv, world_size, several", [
    ([], None, False), (["--nproc", "1"], None, False), (["--nproc", "2"], None, True), (["--dp", "ddp"], None, True),
    (["--ep"], None, True), ([], "2", True), ([], "1", True)])
def test_several_processes_from_the_flags_and_the_environment(argv, world_size, several, monkeypatch):
    "One answer to 'does this run have several processes': --nproc above 1, --dp, --ep, or a torchrun worker (WORLD_SIZE set)."
    from rtrainer.settings import add_train_arguments, apply_run_file, several_processes
    if world_size: monkeypatch.setenv("WORLD_SIZE", world_size)
    else: monkeypatch.delenv("WORLD_SIZE", raising=False)
    p = argparse.ArgumentParser(); add_train_arguments(p)
    assert several_processes(p.parse_args(argv)) is several and several_processes(apply_run_file(p.parse_args(argv))) is several


def test_the_trainer_settings_ask_the_same_question(tmp_path, monkeypatch):
    "A torchrun worker of one process runs the distributed trainer: --memory-budget is refused as a several-process run's."
    from rtrainer.settings import add_train_arguments
    from rtrainer.training import train_config_from_args
    monkeypatch.setenv("WORLD_SIZE", "1")
    p = argparse.ArgumentParser(); add_train_arguments(p)
    args = p.parse_args(["--memory-budget", "10", "--data", "synthetic", "--device", "cpu", "--out-dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--memory-budget runs in one process"): train_config_from_args(args)
