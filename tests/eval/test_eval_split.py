"""The train/test split and the evaluation protocol without a LIBERO simulator: the split
check and its override, provenance of a checkpoint's training, a resumable recording, and the
periodic-evaluation round on real Ray workers (ColorReach stands in for the simulator)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from envs.libero.split import check_split, eval_overlap, split_note, training_overlap
from rlvla3.config import ConfigError, Named


def test_split_refuses_training_on_evaluation_states_unless_allowed():
    bundled = Named("libero", {"placements": "bundled"})
    with pytest.raises(ConfigError, match=r"env_workers\.init_state_ids.*0-39") as err:
        check_split(bundled, list(range(40)))
    assert err.value.field == "env_workers.init_state_ids"
    assert "allow_eval_overlap" in str(err.value) and "placements: fresh" in str(err.value)
    with pytest.raises(ConfigError, match="0-49"):
        check_split(bundled, [])  # empty: every bundled state
    # Disjoint from the evaluated states, or fresh placements, or another env: allowed.
    check_split(bundled, list(range(40)), list(range(40, 50)))
    check_split(Named("libero", {}), list(range(40)))  # fresh is the default
    check_split(Named("reach", {}), [0, 1, 2])
    assert eval_overlap(bundled, [3, 45], list(range(40, 50))) == [45]
    # The override lets it through, and the note every output carries says so.
    allowed = Named("libero", {"placements": "bundled", "allow_eval_overlap": True})
    check_split(allowed, list(range(40)))
    note = split_note(allowed, [0, 1, 2])
    assert note == {"placements": "bundled", "eval_overlap": True,
                    "overlapping_init_states": [0, 1, 2]}
    assert split_note(Named("libero", {"placement_seed": 3}), [0]) == {
        "placements": "fresh", "eval_overlap": False, "placement_seed": 3}
    with pytest.raises(ConfigError, match="env.options.placements"):
        check_split(Named("libero", {"placements": "shuffled"}), [0])


def test_record_cli_refuses_bundled_states_before_starting_anything(tmp_path, capsys):
    from commands.datalake import main as datalake_main

    out = tmp_path / "demos"
    code = datalake_main(["record", "--placements", "bundled", "--episodes", "3", "--output-dir",
                     str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--init-ids/--placements" in err and "0-2" in err and "allow_eval_overlap" in err


def test_training_overlap_follows_runs_datasets_and_init_from(tmp_path):
    data = tmp_path / "demos"
    (data / "meta").mkdir(parents=True)
    (data / "meta" / "record.json").write_text(json.dumps(
        {"split": {"placements": "bundled", "eval_overlap": True,
                   "overlapping_init_states": [0, 1, 2, 7]}}))
    clean = tmp_path / "fresh_demos"
    (clean / "meta").mkdir(parents=True)
    (clean / "meta" / "record.json").write_text(json.dumps(
        {"split": {"placements": "fresh", "eval_overlap": False}}))
    sft = tmp_path / "sft"
    (sft / "checkpoints" / "step-5").mkdir(parents=True)
    (sft / "config.json").write_text(json.dumps({"lake": {"datasets": [str(clean)]}}))
    assert training_overlap(sft) == [] and training_overlap(sft / "checkpoints" / "step-5") == []
    (sft / "config.json").write_text(json.dumps({"lake": {"datasets": [str(clean), str(data)]}}))
    [reason] = training_overlap(sft / "checkpoints" / "step-5")
    assert str(data) in reason and "0-2, 7" in reason
    rl = tmp_path / "rl"
    rl.mkdir()
    config = {"env": {"name": "libero", "options": {"placements": "fresh"}},
              "env_workers": {"init_state_ids": list(range(40))}, "init_from": str(sft)}
    (rl / "config.yaml").write_text(yaml.safe_dump(config))
    assert len(training_overlap(rl)) == 1  # through init_from: the SFT data
    config["env"]["options"] = {"placements": "bundled", "allow_eval_overlap": True}
    (rl / "config.yaml").write_text(yaml.safe_dump(config))
    reasons = training_overlap(rl)
    assert len(reasons) == 2 and "RL run" in reasons[0] and "0-39" in reasons[0]


def test_evaluating_on_fresh_scenes_names_the_ones_training_used(tmp_path):
    from envs.libero.split import FreshEval

    data = tmp_path / "demos"
    (data / "meta").mkdir(parents=True)
    (data / "meta" / "record.json").write_text(json.dumps({
        "provenance": {"suite": "libero_spatial", "placements": "fresh", "placement_seed": 0},
        "recorded_jobs": [[t, k, take] for t in (0, 1) for k in range(20) for take in range(3)],
        "split": {"placements": "fresh", "eval_overlap": False}}))
    sft = tmp_path / "sft"
    sft.mkdir()
    (sft / "config.json").write_text(json.dumps({"lake": {"datasets": [str(data)]}}))

    def fresh(tasks, ids, seed=0):
        return FreshEval("libero_spatial", seed, frozenset(tasks), frozenset(ids))

    assert training_overlap(sft) == []  # a bundled evaluation: fresh training is disjoint
    [reason] = training_overlap(sft, fresh=fresh(range(10), range(5)))
    assert str(data) in reason and "fresh scenes 0-4" in reason
    assert training_overlap(sft, fresh=fresh(range(10), range(20, 30))) == []  # unseen ids
    assert training_overlap(sft, fresh=fresh(range(2, 10), range(5))) == []  # other tasks
    assert training_overlap(sft, fresh=fresh(range(10), range(5), seed=1)) == []  # other seed
    rl = tmp_path / "rl"
    rl.mkdir()
    config = {"env": {"name": "libero", "options": {"suite": "libero_spatial",
                                                     "task_ids": [3, 4]}},
              "env_workers": {"init_state_ids": list(range(100, 200))}}
    (rl / "config.yaml").write_text(yaml.safe_dump(config))
    [reason] = training_overlap(rl, fresh=fresh([4], range(150, 160)))
    assert "RL run" in reason and "150-159" in reason
    assert training_overlap(rl, fresh=fresh([0, 1], range(150, 160))) == []
    config["init_from"] = str(sft)  # and through init_from, the SFT run's dataset
    (rl / "config.yaml").write_text(yaml.safe_dump(config))
    assert len(training_overlap(rl, fresh=fresh([0, 4], range(0, 160)))) == 2


# ---- resumable recording (ColorReach and a scripted expert stand in for LIBERO) ----------
def reach_env():
    from envs.reach import make_reach_env

    return make_reach_env({"chunk_len": 1, "image_size": 16, "max_decisions": 30}, "env", 0)


def reach_expert(env, task_id: int, init_id: int, take: int):
    """Straight at the target."""
    from datalake.record import Demonstration

    obs = env.reset(task_id, init_id)
    observations, actions = [], []
    while True:
        gripper = (obs.state + 1.0) / 2.0
        action = np.clip((np.asarray(env.scene.target) - gripper) / env.config.step_size, -1, 1)
        observations.append(obs)
        actions.append(action.astype(np.float32))
        result = env.step(action[None].astype(np.float32))
        obs = result.obs
        if result.terminated or result.truncated:
            return Demonstration(result.success, observations, actions)


def flaky_expert(marks: Path):
    """``reach_expert`` whose job (1, 1) hits a "simulator fault" while ``marks/fault``
    exists; every call is logged in ``marks/calls.txt`` so the test sees which jobs ran."""

    def expert(env, task_id: int, init_id: int, take: int):
        with (marks / "calls.txt").open("a") as f:
            f.write(f"{task_id}-{init_id}-{take}\n")
        if (task_id, init_id) == (1, 1) and (marks / "fault").exists():
            raise RuntimeError("simulator process died")
        return reach_expert(env, task_id, init_id, take)

    return expert


def test_record_resumes_after_a_fault_without_duplicates(ray_cluster, tmp_path):
    from ray import cloudpickle

    from datalake.format import open_dataset
    from datalake.record import record_dataset, staging_dir
    from datalake.writer import WriterConfig

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    expert = flaky_expert(tmp_path)
    (tmp_path / "fault").touch()
    jobs = [(t, s, 0) for t in (0, 1) for s in range(3)]
    out = str(tmp_path / "demos")
    config = WriterConfig(codec="h264-lossless")
    provenance = {"suite": "reach", "init_ids": [0, 1, 2], "workers": 2}

    def run(workers: int = 2) -> dict:
        return record_dataset(out, reach_env, expert, jobs, workers, config,
                              {**provenance, "workers": workers})

    first = run()
    assert first["unfinished"] == [[1, 1, 0]] and first["recorded"] == 0
    assert not Path(out, "meta", "info.json").exists() and staging_dir(out).is_dir()
    (tmp_path / "fault").unlink()
    (tmp_path / "calls.txt").write_text("")
    second = run(workers=1)  # a resume may change the worker count
    assert (tmp_path / "calls.txt").read_text().split() == ["1-1-0"]  # only the lost job
    assert second["recorded"] == 6 and second["failed"] == [] and not staging_dir(out).exists()
    meta = open_dataset(out)
    assert len(meta.episodes) == 6
    sidecar = json.loads(Path(out, "meta", "record.json").read_text())
    assert sidecar["recorded_jobs"] == [list(j) for j in jobs]
    assert sidecar["provenance"]["suite"] == "reach"
    # Episodes are in job order however the recording was interrupted: job (0, 0) first.
    first_ep = meta.episodes[0]
    assert first_ep.length == len(reach_expert(reach_env(), 0, 0, 0).actions)
    third = run()
    assert third.get("already_complete") and third["recorded"] == 6
    # An unfinished recording is not resumed with other settings.
    other = str(tmp_path / "other")
    (tmp_path / "fault").touch()
    record_dataset(other, reach_env, expert, jobs, 2, config, provenance)
    with pytest.raises(ValueError, match="init_ids"):
        record_dataset(other, reach_env, expert, jobs, 2, config,
                       {**provenance, "init_ids": [0, 1]})


# ---- the evaluation round the RL controller runs beside rollout --------------------------
def _schedule(queue: list, workers: int, lead: int) -> list[list]:
    """The episodes each worker runs when they take turns (as equally fast workers do)."""
    from actors.eval.rounds import next_job

    rank = {state: i for i, state in enumerate(dict.fromkeys(k for _, k in queue))}
    runs: list[list] = [[] for _ in range(workers)]
    turn = 0
    while queue:
        head = rank[queue[0][1]]
        mine = runs[turn]
        job = queue.pop(next_job(queue, mine[-1][0] if mine else None, lead, rank))
        assert rank[job[1]] - head <= lead  # never more than `lead` states ahead of the queue
        mine.append(job)
        turn = (turn + 1) % workers
    return runs


def test_eval_workers_stay_on_their_task_at_most_lead_states_ahead():
    from actors.eval.rounds import next_job, protocol_jobs

    jobs = protocol_jobs(10, range(50))
    rank = {k: k for k in range(50)}
    assert next_job(jobs, None, 4, rank) == 0  # a new worker takes the queue's first episode
    assert next_job(jobs, 3, 4, rank) == 3  # then stays on its task
    assert next_job(jobs[4:], 3, 4, rank) == 9  # task 3's state 1, one state ahead
    assert next_job(jobs[4:], 3, 0, rank) == 0  # lead 0: strictly in order

    def switches(runs: list[list]) -> int:
        return sum(a[0] != b[0] for run in runs for a, b in zip(run[:-1], run[1:], strict=True))

    in_order = _schedule(list(jobs), workers=2, lead=0)
    sticky = _schedule(list(jobs), workers=2, lead=4)
    for runs in (in_order, sticky):
        done = [job for run in runs for job in run]
        assert sorted(done) == sorted(jobs)  # every episode once
    assert switches(in_order) == 400
    assert switches(sticky) == 80  # a simulator build every 6.25 episodes, not every 1.25


def test_evaluate_checkpoint_on_eval_workers(ray_cluster, tmp_path):
    from actors.eval.rounds import EvalRound, evaluate_checkpoint, make_eval_workers, protocol_jobs
    from envs import env_spec
    from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
    from rlvla3.policies import build_policy

    env = Named("reach", {"image_size": 16, "max_decisions": 6})
    spec = env_spec(env)
    choice = Named("small", {"channels": 8, "hidden": 32})
    ckpt = save_checkpoint(tmp_path / "ckpt", build_policy(choice, spec),
                           CheckpointMeta(choice, spec, 3))
    workers = make_eval_workers(env, 2, num_cpus=0.5)
    try:
        summary = evaluate_checkpoint(workers, str(ckpt), tasks=[0, 1, 2], init_ids=[0, 1])
        assert summary["episodes"] == 6 and set(summary["tasks"]) == {"0", "1", "2"}
        for row in summary["tasks"].values():
            assert row["episodes"] == 2 and len(row["ci95"]) == 2
            assert row["ci95"][0] <= row["success_rate"] <= row["ci95"][1]
            assert [e["init_state"] for e in row["by_init_state"]] == [0, 1]
        assert summary["seconds"] > 0 and summary["faults"] == 0
        # Non-blocking: poll() returns at once; episodes arrive over later polls.
        round_ = EvalRound(workers, protocol_jobs(3, [0]), str(ckpt))
        assert len(round_.poll(0.0)) <= 3 and round_.total == 3
        assert len(round_.wait()) == 3 and round_.done
        # A checkpoint that cannot be loaded is an error, not episodes of the previous policy.
        with pytest.raises(ray_cluster.exceptions.RayTaskError, match="no checkpoint"):
            EvalRound(workers, protocol_jobs(1, [0]), str(tmp_path / "missing")).wait()
    finally:
        for w in workers:
            ray_cluster.kill(w)


@pytest.mark.libero
def test_rl_config_refuses_training_on_evaluation_states():
    """RL validation (before any actor starts) applies the split: bundled training states are
    refused unless allowed; periodic evaluation ids are bundled states (0..49)."""
    from actors.rl.startup import check_components
    from rlvla3.run_config import load_run_config

    assert check_components(load_run_config("libero_spatial")).num_init_states > 50  # fresh
    bundled = ["env.options.placements=bundled", "env_workers.init_state_ids=[0, 1]"]
    with pytest.raises(ConfigError) as err:
        check_components(load_run_config("libero_spatial", overrides=bundled))
    assert err.value.field == "env_workers.init_state_ids"
    check_components(load_run_config(
        "libero_spatial", overrides=[*bundled, "env.options.allow_eval_overlap=true"]))
    with pytest.raises(ConfigError) as err:
        check_components(load_run_config("libero_spatial", overrides=["eval_init_state_ids=[60]"]))
    assert err.value.field == "eval_init_state_ids"
