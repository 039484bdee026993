"""User errors end in one line on stderr and exit status 2, before Ray or any actor starts:
a missing optional extra names its install command, a missing dataset names its path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import envs
from rlvla3.config import ConfigError, Named

REPO = Path(__file__).resolve().parents[1]

# Runs each command's main() in one fresh process whose imports of ``libero`` fail (as without
# the extra) and reports exit status, stderr, whether it raised, and whether Ray was started.
RUNNER = r'''
import contextlib, io, json, sys, traceback

class NoLibero:
    def find_spec(self, name, path=None, target=None):
        if name == "libero" or name.startswith("libero."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoLibero())
from rlvla3.__main__ import main

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except BaseException:
            code, err = "raised", io.StringIO(traceback.format_exc())
    ray = sys.modules.get("ray")
    results.append({"argv": argv, "code": code, "stderr": err.getvalue(),
                    "ray_started": bool(ray is not None and ray.is_initialized())})
print(json.dumps(results))
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("errors")
    commands = {
        "rl_libero": ["rl", "--set", "env.name=libero", "--run-dir", str(tmp / "rl")],
        "record_libero": ["datalake", "record", "--output-dir", str(tmp / "rec"), "--episodes", "1"],
        "sft_missing": ["sft", "--dataset", str(tmp / "nonexistent"), "--run-dir", str(tmp / "s")],
        "sft_not_a_dataset": ["sft", "--dataset", str(tmp), "--run-dir", str(tmp / "s")],
        "inspect_missing": ["datalake", "inspect", str(tmp / "nonexistent")],
        "rl_missing_checkpoint": ["rl", "--set", f"init_from={tmp / 'nockpt'}"],
        "rl_used_run_dir": ["rl", "--preset", "smoke", "--run-dir", str(tmp / "used")],
        "sft_used_run_dir": ["sft", "--dataset", str(tmp), "--run-dir", str(tmp / "used")],
        "rl_resume_with_preset": ["rl", "--resume", str(tmp / "used"), "--preset", "smoke"],
    }
    (tmp / "used" / "checkpoints").mkdir(parents=True)
    (tmp / "used" / "checkpoints" / "latest").write_text("step-00000007\n")
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(list(commands.values()))],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dict(zip(commands, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True)), tmp


def _one_line_exit_2(result: dict) -> str:
    assert result["code"] == 2, result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"]
    assert not result["ray_started"], result
    return lines[0]


def test_rl_on_libero_without_the_extra_names_the_install_command(results):
    line = _one_line_exit_2(results[0]["rl_libero"])
    assert line.startswith("rlvla3 rl:") and "'env.name'" in line
    assert 'pip install -e ".[libero]"' in line


def test_record_without_the_libero_extra_names_the_install_command(results):
    line = _one_line_exit_2(results[0]["record_libero"])
    assert line.startswith("rlvla3 datalake record:") and 'pip install -e ".[libero]"' in line


def test_missing_datasets_and_checkpoints_are_named(results):
    out, tmp = results
    line = _one_line_exit_2(out["sft_missing"])
    assert line == f"rlvla3 sft: dataset not found: {tmp / 'nonexistent'} (no such file or directory)"
    line = _one_line_exit_2(out["sft_not_a_dataset"])
    assert f"no LeRobot dataset at {tmp}" in line and "meta/info.json" in line
    line = _one_line_exit_2(out["inspect_missing"])
    assert str(tmp / "nonexistent") in line
    line = _one_line_exit_2(out["rl_missing_checkpoint"])
    assert "'init_from'" in line and str(tmp / "nockpt") in line


def test_a_new_run_refuses_a_directory_holding_another_runs_checkpoints(results):
    out, tmp = results
    for command in ("rl", "sft"):  # the same refusal, the same way out
        line = _one_line_exit_2(out[f"{command}_used_run_dir"])
        assert line.startswith(f"rlvla3 {command}:")
        assert "'--run-dir'" in line and f"--resume {tmp / 'used'}" in line
    line = _one_line_exit_2(out["rl_resume_with_preset"])
    assert "'--resume'" in line and "drop --preset" in line


def test_require_extra_checks_the_module_without_importing_it(monkeypatch):
    monkeypatch.setitem(envs.EXTRAS, "reach", envs.Extra("no_such_module_rlvla3", "pip install x"))
    with pytest.raises(ConfigError, match="no module 'no_such_module_rlvla3'.*pip install x"):
        envs.require_extra(Named("reach"))
    assert envs.missing_extra("latency_replay") == ""  # no extra needed
    with pytest.raises(ConfigError, match="unknown name"):
        envs.require_extra(Named("nope"))


@pytest.mark.slow
def test_a_normal_run_prints_no_ray_error_or_deprecation_noise(tmp_path):
    """A short run from the command line, as a user starts one: it succeeds, and neither Ray's
    core-worker error line (constructor arguments with restarts) nor a deprecation warning nor
    a traceback reaches the terminal."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "rl", "--preset", "smoke", "--set", "total_env_steps=600",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
    for noise in ("core_worker.cc", "DeprecationWarning", "Traceback", "(raylet)"):
        assert noise not in output, f"{noise!r} in the output:\n{output[-3000:]}"
