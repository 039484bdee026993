"""Several Ray nodes on one machine, shaped like cluster.yaml (head, learner, rollout, two sim
nodes; CPU only): roles land on the nodes their resources name, in both placements; a lost
sim node costs its env worker's slots until a new node arrives; a lost rollout node stops the
run with an error that names it. The cluster runs in a subprocess (``tests/support/cluster_scenarios.py``)
so it never meets this session's own Ray; its facts come back as JSON.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.cluster_scenarios import scenario_facts
from support.cluster_scenarios import scenario_result as _scenario

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    return scenario_facts(REPO / "tests" / "support" / "cluster_scenarios.py",
                          tmp_path_factory.mktemp("nodes"), 600,
                          lambda key: key.endswith("_s") or key in ("sim_node_loss",
                                                                    "rollout_node_loss"))


@pytest.mark.slow
def test_roles_land_on_the_nodes_their_resources_name(facts):
    placement = _scenario(facts, "placement")
    full = placement["full"]["nodes"]  # disaggregated
    assert placement["full"]["placement"] == "disaggregated"
    assert full["learner"] == ["learner"] and full["rollout"] == ["rollout"]
    assert sorted(full["env"]) == ["sim0", "sim1"]  # spread: one env worker per sim node
    assert full["queue"] == ["head"] and full["status"] == ["head"]  # the driver's node
    sync = placement["sync"]["nodes"]  # colocated: one bundle, on the only `learner` node
    assert placement["sync"]["placement"] == "colocated"
    assert {n for role in ("learner", "rollout", "env") for n in sync[role]} == {"learner"}
    refused = placement["refused"]  # colocated, but no node offers learner + rollout + sim
    assert refused and refused["field"] == "pipeline.placement", refused
    assert "no autoscaler" in refused["message"]


@pytest.mark.slow
def test_lost_sim_node_costs_its_slots_until_a_new_node_arrives(facts):
    loss = _scenario(facts, "sim_node_loss")
    assert loss["error"] is None, loss["error"]
    assert loss["detected_s"] < 10
    down = loss["row_while_down"]  # the progress rows said so while it lasted
    assert (down["env_slots_live"], down["env_slots_waiting"]) == (2, 2)
    assert down["actors_down"] == {"env_worker": {"1": "RESTARTING"}}
    assert loss["steps_while_down"] > 0  # the other env worker went on
    gone = loss["removed"]
    assert gone not in loss["nodes_after"]["env"] and "sim2" in loss["nodes_after"]["env"]
    summary = loss["summary"]
    assert (summary["env_slots_live"], summary["env_slots_waiting"]) == (4, 0)
    [outage] = summary["outages"]
    assert outage["role"] == "env" and outage["back_after_s"] is not None
    assert summary["restart_counts"]["env_worker"] == 1
    assert summary["restart_counts"]["episodes_lost"] == 2  # its two slots' episodes, counted
    assert summary["lost_segments"] == 0  # the queue's node kept the shipped episodes
    assert abs(summary["accounting"]["unaccounted"]) <= 4 * 20, summary["accounting"]


@pytest.mark.slow
def test_lost_rollout_node_stops_the_run_with_an_error(facts):
    loss = _scenario(facts, "rollout_node_loss")
    assert loss["stopped"], "the run hung after its rollout node left"
    assert "rollout server 0" in loss["error"] and "rollout: 1" in loss["error"]
    assert loss["stopped_after_s"] < loss["node_wait_s"] + 60
