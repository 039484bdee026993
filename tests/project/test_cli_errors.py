"""User errors end in one line on stderr and exit status 2, before Ray or any actor starts:
a missing optional extra names its install command, a missing dataset names its path, a task
id the suite does not have, a plan that does not fit, a cluster that does not answer, a
checkpoint that does not load, a dataset whose files do not open are each named. ``status``
answers within its timeout; a reader that closes stdout early ends a command quietly."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

import envs
from rlvla3.config import ConfigError, Named

REPO = Path(__file__).resolve().parents[2]

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
        "rl_resume_no_optimizer": ["rl", "--resume", str(tmp / "copied")],
        "record_bad_task": ["datalake", "record", "--task-ids", "12", "--episodes", "1",
                            "--output-dir", str(tmp / "rec12")],
        "rl_plan_too_big": ["rl", "--plan", "--plan-gpus", "16", "--plan-sim-cpus", "256",
                            "--plan-cost-model", "pi05_h200", "--set", "env.name=latency_replay",
                            "--run-dir", str(tmp / "planned")],
        "rl_unreachable": ["rl", "--preset", "smoke", "--set", "ray.address=127.0.0.1:1",
                           "--run-dir", str(tmp / "far")],
    }
    (tmp / "used" / "checkpoints").mkdir(parents=True)
    (tmp / "used" / "checkpoints" / "latest").write_text("step-00000007\n")
    _copy_without_optimizer(tmp / "copied")
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(list(commands.values()))],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dict(zip(commands, json.loads(proc.stdout.strip().splitlines()[-1]), strict=True)), tmp


def _copy_without_optimizer(run: Path) -> None:
    """A smoke run's directory whose checkpoint lost the optimizer state its meta.json lists
    (as a copy that keeps only the weights)."""
    import torch
    import yaml

    from rlvla3.checkpoint.files import CheckpointMeta, save_run_checkpoint
    from rlvla3.checkpoint.trust import locate_checkpoint
    from rlvla3.config import to_dict
    from rlvla3.policies import build_policy
    from rlvla3.run_config import load_run_config
    from rlvla3.types import EnvSpec

    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(to_dict(load_run_config("smoke", None, []))))
    spec = EnvSpec(cameras=("cam",), image_size=(16, 16), state_dim=3, action_dim=2,
                   chunk_len=1, max_decisions=10, num_tasks=1, num_init_states=4)
    small = Named("small", {"channels": 4, "hidden": 16})
    policy = build_policy(small, spec)
    save_run_checkpoint(run, policy, CheckpointMeta(small, spec, 3),
                        torch.optim.Adam(policy.parameters()))
    (Path(locate_checkpoint(run)) / "optimizer.pt").unlink()


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


def test_a_resume_whose_checkpoint_lost_its_optimizer_state_names_it_before_ray(results):
    out, tmp = results
    line = _one_line_exit_2(out["rl_resume_no_optimizer"])
    ckpt = tmp / "copied" / "checkpoints" / "step-00000003"
    assert line.startswith(f"rlvla3 rl: invalid config: config field '--resume': {ckpt}: "
                           "optimizer.pt (the optimizer state, which only --resume needs) is "
                           "missing; meta.json lists it ("), line


def test_a_task_id_the_suite_lacks_is_named_before_anything_is_recorded(results):
    out, tmp = results
    line = _one_line_exit_2(out["record_bad_task"])
    assert line == ("rlvla3 datalake record: config field '--task-ids': libero_spatial has "
                    "tasks 0..9, got 12")
    assert not (tmp / "rec12.partial").exists() and not (tmp / "rec12").exists()


def test_a_plan_that_does_not_fit_this_machine_ends_in_one_line(results):
    """``rl --plan`` prints the plan, then the refusal: no traceback."""
    result = results[0]["rl_plan_too_big"]
    assert result["code"] == 2 and "Traceback" not in result["stderr"], result
    assert result["stderr"].startswith("plan for 16 GPUs") and not result["ray_started"]
    last = result["stderr"].strip().splitlines()[-1]
    assert last.startswith("rlvla3 rl: invalid config: config field 'learner.num_learners'")


def test_a_cluster_that_does_not_answer_is_one_line_at_once(results):
    line = _one_line_exit_2(results[0]["rl_unreachable"])
    assert line == ("rlvla3 rl: invalid config: config field 'ray.address': no Ray cluster "
                    "answers at 127.0.0.1:1 (connection refused)")


@pytest.mark.skipif(find_spec("libero") is None, reason="the eval command needs the libero extra")
def test_an_evaluation_of_a_corrupt_checkpoint_stops_before_ray_with_one_line(tmp_path, capsys):
    """Weights overwritten after the save (with a line of text, or with bytes of the same
    size): refused before Ray starts (this test process refuses ``ray.init``), not counted
    as failed episodes."""
    from commands.eval import main as eval_main
    from rlvla3.checkpoint.files import CheckpointMeta, save_run_checkpoint
    from rlvla3.checkpoint.trust import locate_checkpoint
    from rlvla3.policies import build_policy
    from rlvla3.types import EnvSpec

    spec = EnvSpec(cameras=("agentview",), image_size=(16, 16), state_dim=8, action_dim=7,
                   chunk_len=5, max_decisions=44, num_tasks=10, num_init_states=50)
    small = Named("small", {"channels": 4, "hidden": 16})
    save_run_checkpoint(tmp_path / "run", build_policy(small, spec),
                        CheckpointMeta(small, spec, 3))
    weights = Path(locate_checkpoint(tmp_path / "run")) / "policy.safetensors"
    original = weights.read_bytes()
    argv = ["--suite", "libero_spatial", "--checkpoint", str(tmp_path / "run"), "--episodes",
            "0:0", "--output-dir", str(tmp_path / "eval")]
    for damaged, why in ((b"not weights\n", "policy.safetensors holds 12 bytes"),
                         (original[:-64] + bytes(64), "policy.safetensors does not match the "
                                                      "sha256 meta.json lists")):
        weights.write_bytes(damaged)
        assert eval_main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("rlvla3 eval: ") and why in err[0], err
    assert not (tmp_path / "eval" / "results.json").exists()


def test_a_dataset_whose_video_does_not_open_stops_sft_before_ray(tmp_path, capsys):
    """A dataset written here with one video cut to its first third (its index, written
    last, gone): more frames than lake.max_skip_fraction are in files that cannot be read;
    the first one is named, before Ray starts (this test process refuses ``ray.init``)."""
    from commands.sft import main as sft_main
    from datalake import synthetic
    from datalake.writer import WriterConfig, write_dataset

    data = tmp_path / "ds"
    write_dataset(data, synthetic.episodes(4, 8, 12, size=(16, 16)),
                  WriterConfig(codec="h264-lossless", episodes_per_file=2))
    video = data / "videos" / "observation.images.agentview" / "chunk-000" / "file-000.mp4"
    video.write_bytes(video.read_bytes()[: video.stat().st_size // 3])
    assert sft_main(["--dataset", str(data), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlvla3 sft: "), err
    assert "are in files that cannot be read, more than lake.max_skip_fraction" in err[0]
    assert str(video) in err[0] and not (tmp_path / "run").exists()


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_status_answers_within_its_timeout_when_no_cluster_does(tmp_path):
    """A closed port is known at once; a port that accepts connections but is no Ray cluster
    ends after --timeout-s, not after minutes of Ray's connection retries."""
    closed = _listener()
    port = closed.getsockname()[1]
    closed.close()
    silent = _listener()
    try:
        for address, why in ((f"127.0.0.1:{port}", "(connection refused)"),
                             (f"127.0.0.1:{silent.getsockname()[1]}", "within 3s")):
            start = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "rlvla3", "status", "--address",
                                   address, "--timeout-s", "3"], capture_output=True, text=True,
                                  cwd=REPO, timeout=60)
            took = time.monotonic() - start
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, proc.stderr
            assert lines[0].startswith("rlvla3 status: ") and address in lines[0]
            assert why in lines[0] and took < 20, (lines, took)
    finally:
        silent.close()


def test_a_reader_that_closes_stdout_early_ends_the_command_quietly():
    """``rlvla3 rl --print-plan | head``: the closed pipe is no storage error."""
    proc = subprocess.Popen([sys.executable, "-m", "rlvla3", "rl", "--print-plan"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before the command prints anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_require_extra_checks_the_module_without_importing_it(monkeypatch):
    monkeypatch.setitem(envs.EXTRAS, "reach", envs.Extra("no_such_module_rlvla3", "pip install x"))
    with pytest.raises(ConfigError, match="no module 'no_such_module_rlvla3'.*pip install x"):
        envs.require_extra(Named("reach"))
    assert envs.missing_extra("latency_replay") == ""  # no extra needed
    with pytest.raises(ConfigError, match="unknown name"):
        envs.require_extra(Named("nope"))


def test_a_run_that_trains_nothing_says_so_and_json_stays_alone_on_stdout(tmp_path):
    """A budget below the first global batch: the run ends, says in one line that it trained
    nothing and what the first step needs, and exits 1; with --json its summary is the only
    thing on stdout (progress lines on stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "rlvla3", "rl", "--preset", "smoke", "--set", "total_env_steps=1",
         "--set", "learner.global_batch=1024", "--run-dir", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # the whole of stdout: one JSON object
    assert summary["trained_decisions"] == 0 and summary["policy_version"] == 0
    assert summary["staleness_p50"] is None  # nothing measured: null, not NaN
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlvla3 rl: trained nothing: no optimizer step in "), last
    assert "learner.global_batch=1024 decisions" in last and "raise total_env_steps" in last
    assert "steps " in proc.stderr and "[" in proc.stderr  # the progress lines went there


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
