"""Episode traces (``actors.eval.trace``): per decision, hashes of what the policy saw and did;
two runs of one episode compared say at which decision they part and whether the observation
(the simulator) or the action (the policy) parted first. No Ray, no simulator: the worker's
trace of a real episode is checked in ``tests/eval/test_libero_eval.py``."""

from __future__ import annotations

import json

import numpy as np

from actors.eval.trace import (
    decision_hashes,
    first_divergence,
    main,
    read_traces,
    trace_name,
    write_trace,
)
from actors.eval.worker import ActionSource, EvalWorker
from rlvla3.config import Named
from rlvla3.types import Observation


def _obs(pixel: int = 0, state: float = 0.0) -> Observation:
    image = np.full((4, 4, 3), pixel, dtype=np.uint8)
    return Observation(images={"agentview": image, "wrist": image},
                       state=np.full(8, state, dtype=np.float32), instruction="x")


def test_first_divergence_names_the_decision_and_what_parted_first():
    action = np.zeros(7)
    run = [decision_hashes(_obs(), action), decision_hashes(_obs(1), action + 1)]
    assert first_divergence(run, list(run)) == {
        "decision": None, "part": "", "fields": [], "decisions": [2, 2]}
    policy = [run[0], decision_hashes(_obs(1), action + 2)]  # same observation, other action
    assert first_divergence(run, policy)["decision"] == 1
    assert first_divergence(run, policy)["part"] == "action"
    assert first_divergence(run, policy)["fields"] == ["action"]
    simulator = [run[0], decision_hashes(_obs(1, state=1e-6), action + 2)]
    found = first_divergence(run, simulator)
    assert found["part"] == "observation" and found["fields"] == ["action", "state"]
    assert first_divergence(run, run[:1]) == {
        "decision": 1, "part": "length", "fields": [], "decisions": [2, 1]}


def test_traces_written_by_a_worker_compare_across_runs(tmp_path, capsys):
    env = Named("reach", {"image_size": 16})
    worker = EvalWorker(env, ActionSource("random", seed=3), seed=0)
    a, b = worker.run_episode(0, 3, trace=True), worker.run_episode(0, 3, trace=True)
    assert a.trace is not None and len(a.trace) == a.decisions
    assert worker.run_episode(0, 3).trace is None  # only when asked
    write_trace(tmp_path / "a" / "trace" / trace_name(0, 3), a.trace)
    write_trace(tmp_path / "b" / "trace" / trace_name(0, 3), b.trace)
    other = EvalWorker(env, ActionSource("random", seed=4), seed=0).run_episode(0, 3, trace=True)
    write_trace(tmp_path / "c" / trace_name(0, 3), other.trace)
    assert sorted(read_traces(tmp_path / "a")) == [(0, 3)]
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "task 0 state 3: identical over" in capsys.readouterr().out
    assert main([str(tmp_path / "a"), str(tmp_path / "c"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (episode,) = report["episodes"]
    assert episode["decision"] == 0 and episode["part"] == "action"  # the same reset scene
