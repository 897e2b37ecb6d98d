"""The ``phalanx`` command as a user meets it: help, version, no subcommand, warnings, ``bench``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx import cli

from conftest import benchmark_module, run_job

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["run", "demo"]


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("argv", [[], *([c] for c in COMMANDS)])
def test_help_has_examples_and_defaults_and_no_rest_markup(capsys, argv):
    text = _help(capsys, *argv)
    assert "``" not in text and "`" not in text, text  # no raw reST or Markdown quoting
    assert "examples:" in text, text
    if argv:
        assert "(default: " in text, text


def test_run_help_shows_each_default(capsys):
    text = _help(capsys, "run")
    entries = {block.split()[0]: " ".join(block.split()) for block in text.split("\n  -")[1:]}
    for option, default in [("n", "1"), ("-nnodes", "1"), ("-node-rank", "0"), ("-max-restarts", "0")]:
        assert f"(default: {default})" in entries[option], entries[option]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"phalanx {phalanx.__version__} (torch "), out


def test_no_subcommand_prints_help_and_a_hint(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: phalanx"), err
    assert "phalanx demo" in err and "phalanx run -n 2 train.py" in err
    assert "required: cmd" not in err


def test_oversubscription_warning_names_the_cores(monkeypatch):
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    cores = len(os.sched_getaffinity(0))
    assert cli._oversubscription_warning(cores) is None
    warning = cli._oversubscription_warning(cores + 1)
    assert f"-n {cores + 1} starts {cores + 1} CPU replicas on {cores} core(s)" in warning


def test_oversubscription_warning_names_the_gpus(monkeypatch):
    monkeypatch.setattr(cli, "_visible_gpus", lambda: 2)
    assert cli._oversubscription_warning(2) is None
    assert "-n 3 starts 3 replicas on 2 GPU(s)" in cli._oversubscription_warning(3)


def test_run_warns_when_n_exceeds_the_cores(tmp_path):
    """The real command: more replicas than cores still runs, with the warning printed once."""
    n = len(os.sched_getaffinity(0)) + 1
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint(f\"replica {os.environ.get('PHALANX_RANK')}\")\n")
    result = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", str(n), str(script)],
        timeout=120,
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.logs()
    assert result.output.count(f"warning: -n {n} starts {n} CPU replicas") == 1, result.output
    assert "replica 0" in result.output


def test_run_does_not_warn_within_the_cores(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    result = run_job(
        [sys.executable, "-m", "phalanx.cli", "run", "-n", "1", str(script)],
        timeout=120,
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.logs()
    assert "warning" not in result.output, result.output


# ------------------------------------------------------------------------------------ bench
def test_bench_forwards_its_options():
    """`phalanx bench --rounds 0` reaches the suite's own parser (it failed with `unrecognized arguments`)."""
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "--rounds", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--rounds: must be a positive integer; received '0'" in proc.stderr, proc.stderr
    help_ = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "bench", "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert help_.returncode == 0 and "--quick" in help_.stdout and "--out" in help_.stdout, help_.stdout


def _phalanx_command() -> list[str]:
    """The installed ``phalanx`` console script (the one next to this interpreter first)."""
    script = shutil.which("phalanx", path=str(Path(sys.executable).parent)) or shutil.which("phalanx")
    return [script] if script else [sys.executable, "-m", "phalanx.cli"]


@pytest.mark.parametrize(
    "command,usage",
    [
        ([*_phalanx_command(), "bench", "--help"], "usage: phalanx bench "),
        ([sys.executable, "-m", "benchmarks", "--help"], "usage: python -m benchmarks "),
    ],
    ids=["phalanx-bench", "python-m-benchmarks"],
)
def test_bench_help_names_the_command_that_was_typed(command, usage):
    """`phalanx bench --help` printed `usage: python -m benchmarks ...`: each name shows its own."""
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(usage), proc.stdout
    other = "python -m benchmarks" if usage.startswith("usage: phalanx") else "phalanx bench"
    examples = proc.stdout[proc.stdout.index("Examples:") :]
    assert usage.split()[1] in examples and other not in examples, examples


def test_bench_default_output_is_outside_the_repository():
    out = benchmark_module("__main__").default_out_dir().resolve()
    assert ROOT not in out.parents and out.name.startswith("phalanx-bench-")


def torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(torch_cuda_devices() >= 1, reason="this host can run the CUDA benchmark")
def test_bench_cuda_without_gpus_is_skipped_with_the_reason(capsys, tmp_path):
    """`phalanx bench --device cuda` on a host without a GPU says why and exits 77 (skipped), writing nothing."""
    bench = benchmark_module("__main__")
    assert bench.main(["--device", "cuda", "--out", str(tmp_path / "run")]) == bench.SKIPPED == 77
    err = capsys.readouterr().err
    assert "skipped: DeviceNotFoundError: Device 'cuda:0' is not present" in err, err
    assert "HINT:" in err and "one replica per GPU" in err, err
    assert not (tmp_path / "run").exists()


def test_bench_overlap_is_the_hidden_fraction_of_communication():
    bench = benchmark_module("__main__")
    assert bench.overlap(step_s=0.010, ceiling_s=0.010, comm_s=0.004) == 1.0  # nothing added: all hidden
    assert bench.overlap(step_s=0.014, ceiling_s=0.010, comm_s=0.004) == 0.0  # its whole duration added
    assert bench.overlap(step_s=0.011, ceiling_s=0.010, comm_s=0.004) == pytest.approx(0.75)
    assert bench.overlap(step_s=0.009, ceiling_s=0.010, comm_s=0.004) == 1.0  # noise: clamped
    assert bench.overlap(step_s=0.020, ceiling_s=0.010, comm_s=0.004) == 0.0
    with pytest.raises(ValueError, match="received 0"):
        bench.overlap(step_s=0.01, ceiling_s=0.01, comm_s=0)
    # Paired by round, from samples/s (global batch 256): round 1 hides 75 %, round 2 half.
    raw = {"m": {"px_mirrored": [256 / 0.011, 256 / 0.012], "local2": [256 / 0.010] * 2, "px_comm": [256 / 0.004] * 2}}
    got = bench._overlaps(raw)["m"]["px_mirrored"]
    assert got["min"] == pytest.approx(0.5) and got["max"] == pytest.approx(0.75)
    assert got["median"] == pytest.approx(0.625)
    assert "ddp" not in bench._overlaps(raw)["m"]  # no DDP rows measured: no DDP overlap


def test_bench_quick_writes_where_asked_and_keeps_the_committed_results(tmp_path):
    committed = ROOT / "benchmarks" / "results" / "latest.json"
    before = hashlib.sha256(committed.read_bytes()).hexdigest()
    # A relative --out is the user's directory, though the suite runs from the repository root.
    result = run_job(
        [sys.executable, "-m", "phalanx.cli", "bench", "--quick", "--rounds", "1", "--out", "mine"],
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.output
    report = json.loads((tmp_path / "mine" / "latest.json").read_text())
    assert report["quick"] is True and report["rounds"] == 1
    assert set(report["throughput"]["ratios"]) == {"seed_mlp"}
    ratios = report["throughput"]["ratios"]["seed_mlp"]
    assert {"px_mirrored_vs_ddp", "px_mirrored_vs_local2", "ddp_vs_local2"} <= set(ratios)
    assert all(r["median"] > 0 for r in ratios.values())
    assert max(r["bytes"] for r in report["allreduce"]["rows"]) == 1 << 20
    assert f"results: {tmp_path / 'mine' / 'latest.json'}" in result.output
    assert hashlib.sha256(committed.read_bytes()).hexdigest() == before
    print(f"\nphalanx bench --quick --rounds 1: {result.elapsed:.0f} s")


def test_options_after_run_m_module_are_the_modules():
    """`phalanx run -n 2 -m pkg.mod --worker x` failed: argparse took --worker for run's --workers."""
    from phalanx.cli import build_parser, parse

    args = parse(build_parser(), ["run", "-n", "2", "-m", "pkg.mod", "--worker", "x", "-n", "5"])
    assert (args.module, args.command, args.nproc) == ("pkg.mod", ["--worker", "x", "-n", "5"], 2)
    # A script named first keeps its own -m.
    args = parse(build_parser(), ["run", "-n", "2", "train.py", "-m", "z", "--worker", "x"])
    assert (args.module, args.command) == (None, ["train.py", "-m", "z", "--worker", "x"])
