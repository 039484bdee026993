"""Nodes that share no disk, a run kept in an S3 bucket (``tests/support/storage_scenarios.py``, run in a
subprocess like ``tests/support/cluster_scenarios.py``): each node sees only its own scratch directory;
a local run directory on this two-plus-node cluster is refused before any actor starts; the
learner's node is removed mid-run and the learner, restarted on another node, restores the last
checkpoint from the bucket and trains on; ``--resume s3://...`` from another driver continues
the run. The facts (with the timings and the bucket's listing) come back as JSON; ``-s`` shows
them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cluster_scenarios import scenario_facts
from support.cluster_scenarios import scenario_result as _scenario

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    return scenario_facts(REPO / "tests" / "support" / "storage_scenarios.py",
                          tmp_path_factory.mktemp("storage-nodes"), 1200, lambda key: True)


@pytest.mark.slow
def test_every_node_sees_only_its_own_scratch_directory(facts):
    scratch = _scenario(facts, "scratch")
    assert len(set(scratch.values())) == len(scratch) == 4, scratch
    assert all(path.endswith(name if name != "head" else "driver")
               for name, path in scratch.items())


@pytest.mark.slow
def test_a_local_run_dir_on_a_cluster_of_several_nodes_is_refused_before_any_actor(facts):
    refusal = _scenario(facts, "refusal")
    assert refusal["exit"] == 2
    # the line naming the cluster it joined, then one line naming the setting and the ways out
    *joined, line = refusal["stderr"]
    assert len(joined) <= 1 and all(x.startswith("Ray: joined the Ray cluster at ") for x in joined)
    assert "config field 'storage.root'" in line and "local path" in line
    assert "s3://" in line and "storage.shared=true" in line
    assert refusal["named_actors"] == [] and refusal["wrote"] == []


@pytest.mark.slow
def test_the_learner_restarted_on_another_node_restores_from_the_bucket(facts):
    loss = _scenario(facts, "learner_node_loss")
    assert loss["error"] is None, loss["error"]
    assert loss["nodes_before"]["learner"] == [loss["removed"]]
    [survivor] = loss["nodes_after"]["learner"]
    assert survivor != loss["removed"] and survivor.startswith("learner_")
    restored = loss["restored_stats"]
    assert restored["restored_from"].startswith("step-")  # a checkpoint, not initial weights
    assert int(restored["restored_from"].split("-")[1]) == restored["version"]
    assert loss["latest_at_removal"] <= restored["version"] <= loss["version_at_removal"]
    assert loss["survivor_scratch"], "the new node downloaded nothing: where did it restore from?"
    assert loss["loss_seen_s"] <= loss["restored_s"] <= loss["training_again_s"]
    summary = loss["summary"]
    assert summary["restart_counts"]["learner"] == 1
    assert summary["run_dir"] == "s3://runs/nodes-share-nothing"
    assert abs(summary["accounting"]["unaccounted"]) <= 4 * 20, summary["accounting"]
    listing = loss["listing"]
    assert {"config.yaml", "summary.json", "metrics.jsonl", "checkpoints/latest"} <= set(listing)
    assert any(name.startswith("tb/events.out.tfevents") for name in listing)


@pytest.mark.slow
def test_resume_from_the_bucket_on_another_driver_continues_the_run(facts):
    resume = _scenario(facts, "resume")
    assert resume["exit"] == 0, resume["stderr_tail"]
    summary = resume["summary"]
    assert summary["env_steps"] >= resume["target"] > resume["env_steps_before"]
    assert summary["policy_version"] > resume["version_before"]
    assert summary["this_leg"]["env_steps"] < summary["env_steps"]  # counted over the whole run
    assert resume["resumed_line"] and resume["latest_version"] == summary["policy_version"]
    # the driver kept nothing of the run on its own disk (its working copies went at the end)
    assert resume["local_files_of_the_driver"] == []
