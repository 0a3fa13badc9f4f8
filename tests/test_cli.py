"""The command-line contract (DESIGN.md): --json gives one object; bad input gives one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from corrnoise.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_loss_json_has_the_contract_fields(capsys):
    code, out, err = run(capsys, "loss", "toeplitz-sqrt", "--n", "64", "--participation", "cyclic:4:16", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    for key in ("rms_loss", "max_loss", "sensitivity", "mean_error", "max_error"):
        assert isinstance(data[key], float)
    assert data["participation"] == "cyclic:4:16"


def test_loss_table_is_readable(capsys):
    code, out, _ = run(capsys, "loss", "bsr:4", "--n", "32", "--workload", "momentum:0.9")
    assert code == 0 and "rms_loss" in out and "momentum:0.9" in out


def test_loss_of_toeplitz_sqrt_at_a_million_steps(capsys):
    code, out, _ = run(capsys, "loss", "toeplitz-sqrt", "--n", "1000000", "--json")
    data = json.loads(out)
    # Tutorial Thm 2.7: Opt_Toep <= (gamma + ln n) / pi + 1.
    assert code == 0 and data["max_loss"] <= (0.5772156649 + np.log(1e6)) / np.pi + 1


@pytest.mark.parametrize(
    "argv,param",
    [
        (["loss", "dpcgd:1.0", "--n", "8"], "beta"),
        (["loss", "dpcgd:nan", "--n", "8"], "beta"),
        (["loss", "identity", "--n", "0"], "n"),
        (["loss", "identity", "--n", "-3"], "n"),
        (["loss", "identity", "--n", "10", "--participation", "cyclic:2:3"], "participation"),
        (["loss", "identity", "--n", "10", "--participation", "minsep:5:3"], "participation"),
        (["loss", "identity", "--n", "10", "--participation", "weekly"], "participation"),
        (["loss", "blt:0.2:1.0", "--n", "10"], "lambda"),
        (["loss", "blt:0.2:-0.5", "--n", "10"], "lambda"),
        (["loss", "identity", "--n", "10", "--workload", "momentum:1.5"], "beta"),
        (["loss", "nosuch", "--n", "10"], "strategy"),
        (["loss", "identity", "--n", "ten"], "--n"),
    ],
)
def test_bad_input_gives_one_line_naming_the_parameter(capsys, argv, param):
    code, out, err = run(capsys, *argv)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and param in lines[0] and "Traceback" not in err


def test_bad_matrices_via_the_console_script(tmp_path):
    path = tmp_path / "upper.npy"
    np.save(path, np.triu(np.ones((4, 4))))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from corrnoise.cli import main; sys.exit(main())", "loss", f"matrix:{path}", "--n", "4"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "matrix" in proc.stderr and "lower-triangular" in proc.stderr


def test_python_m_corrnoise_is_the_console_script(tmp_path):
    """``python -m corrnoise`` failed (no corrnoise/__main__.py): it runs the console script's entry
    point (pyproject.toml [project.scripts]), exit codes and one-line errors included."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["corrnoise"] == "corrnoise.cli:main"
    import os

    import corrnoise

    # the package this test imports, also from another directory (a relative PYTHONPATH=src would not be)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(corrnoise.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    ok = subprocess.run([sys.executable, "-m", "corrnoise", "--help"], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "Usage:" in ok.stdout and "plan" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "corrnoise", "train", "--dataset", "nope"], capture_output=True,
                         text=True, cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "dataset" in bad.stderr


def test_mechanism_file_is_accepted_by_loss(capsys, tmp_path):
    from corrnoise.strategies import BLT, save_mechanism

    path = save_mechanism(BLT([0.3, 0.1], [0.99, 0.5], 100), tmp_path / "blt.json")
    code, out, _ = run(capsys, "loss", str(path), "--n", "1000000000", "--json")
    assert code == 0 and json.loads(out)["n"] == 10**9


def test_demo_runs(capsys):
    code, out, _ = run(capsys, "demo", "--n", "64", "--json")
    assert code == 0 and len(json.loads(out)["results"]) >= 5


def test_requested_verification_is_never_dropped_silently(capsys):
    code, out, err = run(capsys, "account", "identity", "--n", "100", "--batching", "poisson:0.01", "--sigma", "1",
                         "--delta", "1e-5", "--verify")
    assert code == 2 and out == "" and "verify" in err and len(err.strip().splitlines()) == 1


def test_lower_bound_cannot_calibrate_noise(capsys):
    code, out, err = run(capsys, "account", "toeplitz-sqrt", "--n", "8", "--batching", "poisson:0.5", "--epsilon", "4",
                         "--delta", "1e-5", "--method", "mmcc", "--lower-bound")
    assert code == 2 and out == "" and "lower_bound" in err


def test_failed_verification_releases_nothing(capsys):
    # Far too few samples for delta = 1e-5: Thm 2.2's failure probability cannot be <= delta.
    code, out, err = run(capsys, "account", "identity", "--n", "4", "--batching", "balls-in-bins:2", "--noise-std", "1",
                         "--delta", "1e-5", "--verify", "--samples", "1000", "--verify-samples", "100000",
                         "--seed", "0")
    assert code == 2 and out == "" and err.startswith("error: verify:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("compare, says", [("bsr:abc", "needs an integer B"), ("dpcgd:2", "must lie in [0, 1)"),
                                           ("bsr:2000", "must be <= n = 22")])
def test_a_bad_compare_name_is_refused_before_the_first_run_trains(capsys, monkeypatch, compare, says):
    """Review: only an unknown name was caught up front; a malformed family parameter, or one too
    large for the run's steps (22 here: digits, batch 64, 1 epoch), ended the command after the
    first run had trained (minutes on Fashion-MNIST), its result lost."""
    import corrnoise.training

    def no_training(*args, **kwargs):
        raise AssertionError("the first run trained before the second run's name was checked")

    monkeypatch.setattr(corrnoise.training, "train", no_training)
    code = main(["train", "--dataset", "digits", "--mechanism", "dpsgd", "--batching", "cyclic", "--epochs", "1",
                 "--epsilon", "2", "--delta", "1e-5", "--compare", compare])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: compare: ") and says in err and "\n" not in err


@pytest.mark.parametrize("args, param", [
    (["plan", "--dataset-size", "1000", "--batch-size", "100", "--epochs", "1", "--epsilon", "2", "--delta", "1e-5",
      "--mechanism-file", "x.txt"], "mechanism_file"),
    (["train", "--dataset", "digits", "--epsilon", "2", "--delta", "1e-5", "--physical-batch-size", "0"],
     "physical_batch_size"),
    (["train", "--dataset", "digits", "--epsilon", "2", "--delta", "1e-5", "--compare", " "], "compare"),
    # review: these named "mechanism" (the second run's, or a run of 0 steps)
    (["train", "--dataset", "digits", "--mechanism", "dpsgd", "--epsilon", "2", "--delta", "1e-5", "--epochs", "1",
      "--compare", "bogus"], "compare"),
    (["audit", "--dataset", "digits", "--white-box", "--epsilon", "2", "--batch-size", "100000"], "batch_size"),
])
def test_cli_errors_name_the_option_given(capsys, args, param):
    code = main(args)
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(f"error: {param}: ") and "\n" not in err


def test_a_planner_name_outside_a_planned_run_and_the_epochs_help_say_what_is_taken(capsys):
    """``account bandmf:8`` pointed to ``bandmf``, which account refuses (it plans no run); the help of
    ``plan --epochs`` said FLOAT where the planner takes whole epochs (both found by a user probe)."""
    assert main(["account", "bandmf:8", "--n", "100", "--batching", "none", "--sigma", "1", "--delta", "1e-5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "where a run is planned" in err and "corrnoise optimize banded" in err
    from click.testing import CliRunner

    from corrnoise.cli import cli

    assert "--epochs INTEGER" in CliRunner().invoke(cli, ["plan", "--help"]).output


def test_account_and_train_write_progress_lines_where_stderr_is_not_a_terminal(capsys, monkeypatch):
    """A piped run was silent for minutes (a Monte Carlo calibration in account, the training loop
    of train); both now write LineProgress lines on stderr (here without its quiet first second)."""
    from corrnoise.progress import LineProgress

    init = LineProgress.__init__

    def quick(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "after": 0.0, "every": 0.0, "gap": 0.0})

    monkeypatch.setattr(LineProgress, "__init__", quick)
    assert main(["account", "bsr:2", "--n", "20", "--batching", "balls-in-bins:10", "--epsilon", "2",
                 "--delta", "1e-3", "--samples", "20000"]) == 0
    err = capsys.readouterr().err
    assert "corrnoise [" in err and "verifying" in err
    assert main(["train", "--dataset", "digits", "--mechanism", "bsr:2", "--batching", "cyclic", "--epsilon", "8",
                 "--delta", "1e-5", "--epochs", "1", "--batch-size", "256"]) == 0
    assert "training" in capsys.readouterr().err


def test_bench_noise_writes_progress_lines_where_stderr_is_not_a_terminal(capsys, monkeypatch):
    """`corrnoise bench noise` (the README's line: 15 s) wrote nothing on a pipe; now a line per
    mechanism, k of their number, and the end (here without LineProgress's quiet first second); with
    --json stderr stays quiet."""
    from corrnoise.progress import LineProgress

    init = LineProgress.__init__

    def quick(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "after": 0.0, "every": 0.0, "gap": 0.0})

    monkeypatch.setattr(LineProgress, "__init__", quick)
    args = ["bench", "noise", "--dim", "1000", "--steps", "2", "--mechanisms", "dpsgd;bsr:4"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "noise: dpsgd" in err and "noise: bsr:4 1/2" in err and "noise: done in" in err
    assert main([*args, "--json"]) == 0
    assert capsys.readouterr().err == ""
