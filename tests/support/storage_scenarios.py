"""A cluster whose nodes share no disk, keeping its run in an S3 bucket (the moto server on
loopback, ``tests/support/s3_server.py``), on one machine.

Run as a subprocess by ``tests/rl/test_cluster_storage.py`` (``python tests/support/storage_scenarios.py
OUT.json``), like ``tests/support/cluster_scenarios.py`` (whose process marker, cleanup and helpers it
uses). Every node of the ``ray.cluster_utils.Cluster`` gets a scratch directory of its own
(``RLVLA3_SCRATCH`` in its raylet's environment, which its workers inherit) and a custom
resource naming it (``node_<name>``); the driver has its own scratch too. No run directory is
shared: the run's only location is ``s3://runs/<name>``; credentials and the endpoint reach
every process through the ``AWS_*`` environment, as on a real cluster.

Nodes: ``head`` (the driver; no CPUs), ``learner_a`` and ``learner_b`` (each offers ``learner``),
``actors`` (the rollout server and both env workers).

Scenarios, in order (facts written to OUT.json after each):
- ``scratch``: a task on each node reports the scratch directory it sees (each its own).
- ``refusal``: ``rlvla3 rl`` joined to this cluster with a local ``--run-dir`` and no
  ``storage.shared``: one line on stderr naming ``storage.root``, exit status 2, no actor.
- ``learner_node_loss``: a run keeps checkpoints in the bucket; the learner's node is removed
  (and its scratch directory deleted) mid-run; the learner restarts on the other learner node,
  restores the last checkpoint from the bucket into that node's scratch and trains on. Timings
  from the removal: the loss seen, the learner restored, its first optimizer step after.
- ``resume``: ``rlvla3 rl --resume s3://runs/<name>`` from another driver (its own scratch)
  continues the run to a larger budget; then the bucket's listing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cluster_scenarios import (
    REPO,
    TINY,
    Facts,
    _run_in_thread,
    _wait,
    last_row,
    node_names,
    run_scenarios,
    where,
)
from s3_server import S3Server

NODES = {  # name -> (CPUs, custom resources)
    "learner_a": (2, {"learner": 1}),
    "learner_b": (2, {"learner": 1}),
    "actors": (3, {"rollout": 1, "sim": 2}),
}
ROLES = [o for o in TINY if not o.startswith("storage.")] + [
    "rollout.resources={rollout: 1}", "env_workers.resources={sim: 1}", "pipeline.mode=full",
    "checkpoint_every=2", "ray.node_wait_s=180"]
"""The roles on their nodes, the run's storage not declared shared: it is a bucket."""
RUN = "s3://runs/nodes-share-nothing"


def start_cluster(scratch: Path):
    import ray
    from ray.cluster_utils import Cluster

    from actors.runtime.bootstrap import NAMESPACE

    start = time.monotonic()
    os.environ["RLVLA3_SCRATCH"] = str(scratch / "driver")  # the head's raylet inherits it
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "resources": {"node_head": 1},
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}})
    nodes = {}
    for name, (cpus, resources) in NODES.items():
        (scratch / name).mkdir(parents=True)
        nodes[name] = cluster.add_node(num_cpus=cpus, resources={**resources, f"node_{name}": 1},
                                       env_vars={"RLVLA3_SCRATCH": str(scratch / name)})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    return cluster, nodes, round(time.monotonic() - start, 1)


def scenario_scratch(facts: Facts, cluster, nodes, scratch: Path) -> None:
    import ray

    @ray.remote(num_cpus=0)
    def seen() -> str:
        return os.environ.get("RLVLA3_SCRATCH", "")

    facts.put("scratch", {name: ray.get(seen.options(resources={f"node_{name}": 0.01}).remote())
                          for name in ["head", *nodes]})


def rl_cli(args: list[str], cluster, scratch: Path, timeout_s: float
           ) -> subprocess.CompletedProcess:
    """``rlvla3 rl`` joined to the cluster, as ``ray job submit`` would run it."""
    env = {**os.environ, "RAY_ADDRESS": cluster.address, "RLVLA3_SCRATCH": str(scratch),
           "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "rlvla3", "rl", *args], env=env, cwd=scratch,
                          capture_output=True, text=True, timeout=timeout_s)


def scenario_refusal(facts: Facts, cluster, nodes, scratch: Path) -> None:
    import ray

    work = scratch / "refusal"
    work.mkdir()
    start = time.monotonic()
    proc = rl_cli(["--preset", "smoke", "--run-dir", str(work / "run"), *sum(
        (["--set", o] for o in ROLES), [])], cluster, work, 300)
    facts.put("refusal", {
        "exit": proc.returncode, "stderr": proc.stderr.strip().splitlines(),
        "seconds": round(time.monotonic() - start, 1),
        "named_actors": ray.util.list_named_actors(all_namespaces=True),
        "wrote": sorted(str(p.relative_to(work)) for p in work.rglob("*"))})


def bucket_listing(uri: str) -> dict[str, int]:
    from rlvla3.checkpoint.storage import Storage

    return dict(sorted(Storage(uri).sizes().items()))


def scenario_learner_node_loss(facts: Facts, cluster, nodes, scratch: Path) -> None:
    import ray

    from actors.rl.controller import Controller
    from actors.runtime.cluster_state import actor_state
    from rlvla3.checkpoint.files import read_meta
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("smoke", overrides=ROLES + ["total_env_steps=100000000"])
    controller = Controller(cfg, RUN)
    topo = controller.build()
    names = node_names(nodes, cluster)
    thread, result = _run_in_thread(controller)
    out: dict = {"nodes_before": where(topo, names)}
    learner = topo.learners[0]
    version = lambda: ray.get(learner.version.remote(), timeout=60)  # noqa: E731

    def saved_version() -> int:
        try:
            return read_meta(RUN).version
        except FileNotFoundError:  # no checkpoint yet
            return -1
    try:
        _wait(lambda: version() >= 6, "the learner at version 6", 300, result)
        _wait(lambda: saved_version() >= 4, "a checkpoint in the bucket", 120, result)
        victim = out["nodes_before"]["learner"][0]
        out["removed"] = victim
        out["version_at_removal"] = version()
        out["latest_at_removal"] = read_meta(RUN).version
        old = ray.get(learner.stats.remote()).incarnation
        cluster.remove_node(nodes.pop(victim))
        removed = time.monotonic()
        shutil.rmtree(scratch / victim)  # its disk went with it
        since = lambda: round(time.monotonic() - removed, 1)  # noqa: E731
        _wait(lambda: actor_state(learner) != "ALIVE", "the loss seen", 120, result)
        out["loss_seen_s"] = since()

        def restored() -> bool:
            try:
                stats = ray.get(learner.stats.remote(), timeout=5)
            except (ray.exceptions.RayError, TimeoutError):
                return False
            out["restored_stats"] = {k: getattr(stats, k) for k in ("restored_from", "version", "rank")}
            return stats.incarnation != old

        _wait(restored, "the learner restored", 300, result)
        out["restored_s"] = since()
        start_version = out["restored_stats"]["version"]
        _wait(lambda: version() > start_version, "an optimizer step after the restore", 300,
              result)
        out["training_again_s"] = since()
        out["nodes_after"] = where(topo, node_names(nodes, cluster))
        survivor = out["nodes_after"]["learner"][0]
        out["survivor_scratch"] = sorted(
            str(p.relative_to(scratch)) for p in (scratch / survivor / "checkpoints").glob("*"))
        _wait(lambda: version() >= start_version + 4, "training on", 300, result)
        try:  # the progress rows follow the restored learner
            _wait(lambda: last_row(controller.run_dir).get("policy_version", 0) > start_version,
                  "a progress row past the restored version", 60, result)
            out["rows_show_training_again_s"] = since()
        except TimeoutError:
            out["rows_show_training_again_s"] = None
        out["last_row"] = {k: last_row(controller.run_dir).get(k) for k in (
            "policy_version", "env_steps", "actors_down", "restart_counts")}
        controller.request_stop("scenario done")
        thread.join(timeout=300)
    finally:
        controller.request_stop("scenario done")
        thread.join(timeout=60)
        controller.shutdown()
    summary = result.get("summary") or {}
    out["error"] = result.get("error")
    out["summary"] = {k: summary.get(k) for k in (
        "env_steps", "episodes", "policy_version", "restart_counts", "accounting",
        "checkpoints", "run_dir", "stopped_by", "lost_segments")}
    out["listing"] = bucket_listing(RUN)
    facts.put("learner_node_loss", out)


def scenario_resume(facts: Facts, cluster, nodes, scratch: Path) -> None:
    from rlvla3.checkpoint.files import read_meta
    from rlvla3.checkpoint.storage import Storage

    before = json.loads(Storage(RUN).read_text("summary.json"))
    work = scratch / "second-driver"
    work.mkdir()
    target = before["env_steps"] + 2000
    start = time.monotonic()
    proc = rl_cli(["--resume", RUN, "--set", f"total_env_steps={target}", "--json"], cluster,
                  work, 600)
    out: dict = {"exit": proc.returncode, "seconds": round(time.monotonic() - start, 1),
                 "stderr_tail": proc.stderr.strip().splitlines()[-5:],
                 # with --json, stdout holds the summary alone and the progress goes to stderr
                 "resumed_line": [line for line in proc.stderr.splitlines()
                                  if line.startswith("resumed at version")],
                 "env_steps_before": before["env_steps"], "version_before": before[
                     "policy_version"], "target": target}
    if proc.returncode == 0:
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        out["summary"] = {k: summary.get(k) for k in (
            "env_steps", "policy_version", "this_leg", "stopped_by", "run_dir", "checkpoints")}
        out["latest_version"] = read_meta(RUN).version
        out["metrics_rows"] = len(Storage(RUN).read_text("metrics.jsonl").splitlines())
    out["local_files_of_the_driver"] = sorted(
        str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    out["listing"] = bucket_listing(RUN)
    facts.put("resume", out)


def main(out_path: str) -> int:
    facts = Facts(Path(out_path))
    scratch = Path(out_path).parent / "scratch"
    server = S3Server(Path(out_path).parent)
    os.environ.update(server.env)  # every process of the cluster inherits the endpoint
    server.create_bucket("runs")
    cluster, nodes, started_s = start_cluster(scratch)
    facts.put("cluster_start_s", started_s)
    try:
        run_scenarios(facts, (scenario_scratch, scenario_refusal, scenario_learner_node_loss,
                              scenario_resume), cluster, nodes, scratch)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main(sys.argv[1]))
