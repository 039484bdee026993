"""What a job's terminal shows of Ray: its workers' own lines, without Ray's chatter and without
colour codes when the output is not a terminal (``actors.runtime.quiet``); a worker's state API
call (Ray Train's placement-group cleaner makes one) reaches its own cluster even when another
Ray runs on the machine; ``rlvla3 status`` names the cluster it read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from actors.runtime.bootstrap import dashboard_installed
from actors.runtime.quiet import LogFilter

REPO = Path(__file__).resolve().parents[2]

NOISY_WORKER = textwrap.dedent('''
    import sys, time
    import ray
    from actors.runtime.bootstrap import init_ray

    init_ray(num_cpus=1, include_dashboard=False)

    @ray.remote
    def talk():
        print("[sft] step 10/30 loss 1.9113", flush=True)
        print("[2026-12-06 00:30:45,740 E 11150 11229] core_worker.cc:2465: Actor with class "
              "name: 'PreemptionWatcher' and ID: '5ae4' has constructor arguments in the object "
              "store and max_restarts > 0.", file=sys.stderr, flush=True)
        print("Requesting resources: {'CPU': 1} * 1", flush=True)
        print("\\x1b[33mcoloured\\x1b[0m warning of a library", file=sys.stderr, flush=True)

    ray.get(talk.remote())
    time.sleep(3)  # the driver prints its workers' lines as they arrive
    ray.shutdown()
''')


def test_a_drivers_output_keeps_its_workers_lines_without_ray_chatter_or_colour():
    proc = subprocess.run([sys.executable, "-c", NOISY_WORKER], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert "[sft] step 10/30 loss 1.9113" in proc.stdout, output
    assert "coloured warning of a library" in proc.stderr, output
    assert "PreemptionWatcher" not in output and "Requesting resources" not in output, output
    assert "\x1b[" not in output, output  # stderr is a pipe here: no colour codes
    assert "Ray: started a local Ray cluster at " in proc.stderr, output


STATE_FROM_A_WORKER = textwrap.dedent('''
    import subprocess, sys
    import ray
    from actors.runtime.bootstrap import init_ray

    other = subprocess.Popen([sys.executable, "-c", "import ray, time; ray.init(num_cpus=1, "
                              "include_dashboard=False); print('up', flush=True); "
                              "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "up"  # another Ray runs on this machine
        init_ray(num_cpus=1)

        @ray.remote
        class Mine:
            def ping(self):
                return 1

        mine = Mine.options(name="mine-for-the-state-api").remote()
        ray.get(mine.ping.remote())

        @ray.remote
        def names():
            from ray.util.state import list_actors

            return [a.name for a in list_actors()]

        print("ACTORS", ray.get(names.remote()))
        ray.shutdown()
    finally:
        other.kill()
''')


@pytest.mark.skipif(not dashboard_installed(), reason="the state API needs ray[default]")
def test_a_workers_state_api_reaches_its_own_cluster_with_another_ray_on_the_machine():
    """Without the cluster's address a worker's state API looked for "the" Ray of the machine
    and, with two, failed ("Found multiple active Ray instances"): Ray Train's placement-group
    cleaner printed that traceback on every SFT run beside another Ray."""
    proc = subprocess.run([sys.executable, "-c", STATE_FROM_A_WORKER], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "'mine-for-the-state-api'" in proc.stdout, proc.stdout
    assert "Found multiple active Ray instances" not in proc.stdout + proc.stderr


def test_status_names_the_cluster_it_read(ray_cluster):
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.run([sys.executable, "-m", "rlvla3", "status", "--address", address,
                           "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []  # no rlvla3 run on the test's cluster
    assert proc.stderr.strip() == f"rlvla3 status: the Ray cluster at {address}", proc.stderr
    proc = subprocess.run([sys.executable, "-m", "rlvla3", "status", "--address", address],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.stdout.strip() == f"rlvla3 status: no rlvla3 runs on the Ray cluster at {address}"


def test_the_filter_drops_ray_train_reporting_a_failure_the_driver_raises_itself():
    keep = LogFilter(colour=False)
    worker = {"pid": 7, "actor_name": "RayTrainWorker", "lines": [
        "skipping 1 sample(s): video a.mp4: decoding failed", "Error in training function:",
        "Traceback (most recent call last):", "datalake.pipeline.LakeError: skipped 19 of 34"]}
    other = {"pid": 8, "lines": ["\x1b[32m[sft] step 4/5\x1b[0m"]}
    assert keep(worker)["lines"] == ["skipping 1 sample(s): video a.mp4: decoding failed"]
    assert keep({**worker, "lines": ["  File \"x.py\", line 3"]}) is None  # the same report
    assert keep(other)["lines"] == ["[sft] step 4/5"]
