"""Autoscaled simulator nodes on one machine: a head started with an autoscaling config whose
``sim_cpu`` node type goes from 0 to 3 nodes (Ray's ``fake_multinode`` provider, which starts
each node as local processes, as ``ray.cluster_utils.AutoscalingCluster`` does). A run asking
for three env workers on ``sim`` waits for nodes (``rlvla3 status`` says which are launching and
what waits), starts on the first, uses the others as they arrive, and the idle nodes are
released after it. Runs in a subprocess (``tests/support/cluster_scenarios.py --autoscaling``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support.cluster_scenarios import kill_marked, scenario_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_sim_nodes_scale_up_for_waiting_slots_and_down_when_idle(tmp_path):
    marker = str(tmp_path)
    env = scenario_env(marker)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "cluster_scenarios.py"),
                               "--autoscaling", str(tmp_path / "facts.json")], env=env, cwd=REPO,
                              text=True, capture_output=True, timeout=600)
    finally:
        kill_marked(marker)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    facts = json.loads((tmp_path / "facts.json").read_text())
    print(json.dumps(facts))
    assert "autoscaling" in facts, facts.get("scenario_autoscaling_error") or proc.stderr[-3000:]
    out = facts["autoscaling"]
    assert out["error"] is None, out["error"]
    assert out["sim_nodes_at_start"] == 0
    waiting = out["status_while_waiting"]  # rlvla3 status, while the nodes were launching
    assert waiting and waiting["env_slots_waiting"] > 0
    assert "sim: 1" in waiting["resource_demand"]  # what waits for room
    assert waiting["pending_nodes"] is not None  # and what the autoscaler is launching
    assert out["first_sim_node_s"] <= out["all_sim_nodes_s"] <= out["all_slots_running_s"]
    assert len(set(out["env_nodes"])) == 3  # one env worker on each new node
    assert out["released_after_run_s"] < 120


def test_a_fresh_head_without_an_autoscaler_is_read_only_after_its_first_report(tmp_path):
    """Right after ``ray.init`` the monitor's status holds only load metrics; the answer waits
    for the autoscaler's report (which names every node's type) instead of reading its absence."""
    marker = str(tmp_path)
    env = scenario_env(marker)
    script = (
        "import json, ray\n"
        "from ray.experimental.internal_kv import _internal_kv_get\n"
        "from actors.runtime.cluster_state import can_add_nodes\n"
        "ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)\n"
        "answer = can_add_nodes(wait_s=60)\n"
        "status = json.loads(_internal_kv_get('__autoscaling_status'))\n"
        "print(json.dumps({'can_add': answer, 'report': status.get('autoscaler_report') is not None}))\n"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, text=True,
                              capture_output=True, timeout=180)
    finally:
        kill_marked(marker)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"can_add": False, "report": True}
