"""Multi-node scenarios on one machine: a ``ray.cluster_utils.Cluster`` shaped like cluster.yaml
(a head without CPUs, a ``learner`` node, a ``rollout`` node, two ``sim`` nodes; CPU only).

Run as a subprocess by ``tests/rl/test_cluster_nodes.py`` (``python tests/support/cluster_scenarios.py
OUT.json``), so that its Ray cluster never meets the test session's own: every process it
starts carries the marker ``RLVLA3_TEST_CLUSTER`` in its environment (and ``RAY_TMPDIR``, a temp
dir of its own, ``scenario_env``), and the test kills what is left of them, by pid, when it
ends. Facts are written to OUT.json after each scenario, so a
failure late in the run still reports what came before.

Scenarios, in order:
- ``placement``: disaggregated and colocated runs are built (not run) and every actor's node is
  read back from the GCS; a plan that fits no node is refused before any actor starts.
- ``sim_node_loss``: a sim node leaves mid-run (its env worker cannot be placed elsewhere: the
  run goes on with fewer slots and says so); a new sim node joins and the env worker returns.
- ``rollout_node_loss``: the only rollout node leaves; no node offers ``rollout`` any more, so
  the run stops with an error naming the server after ``ray.node_wait_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = "RLVLA3_TEST_CLUSTER"
SHAPE = {  # node -> (CPUs, custom resources): cluster.yaml's node types, scaled down
    "learner": (2, {"learner": 1}),
    "rollout": (1, {"rollout": 1}),
    "sim0": (1, {"sim": 1}),
    "sim1": (1, {"sim": 1}),
}
TINY = [
    "storage.shared=true",  # the simulated nodes share this machine's disk
    "env.options.image_size=16", "env_workers.num_workers=2", "env_workers.slots_per_worker=2",
    "learner.global_batch=32", "learner.micro_batch=16", "policy.options.channels=8",
    "policy.options.hidden=32", "log_every_s=1.0", "checkpoint_every=0", "ray.node_wait_s=15",
    "ray.placement_timeout_s=60", "learner.resources={learner: 1}",
]
ROLES = TINY + ["rollout.resources={rollout: 1}", "env_workers.resources={sim: 1}"]
"""Each role on its node type, as a cluster config would say."""


def marked_pids(marker_value: str) -> list[int]:
    """Processes whose environment carries ``RLVLA3_TEST_CLUSTER=<marker_value>``."""
    needle = f"{MARKER}={marker_value}".encode() + b"\0"
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{entry}/environ").read_bytes():
                    pids.append(int(entry))
    return pids


def scenario_env(marker_value: str) -> dict[str, str]:
    """The environment of a scenario subprocess: the marker, a patient raylet start (2 busy
    cores), and Ray's temp dir of its own (``RAY_TMPDIR``, short for socket paths): its session
    files and the address file every driver writes (``ray_current_cluster``, which a plain
    ``ray.init()`` anywhere on the machine would follow) stay out of /tmp/ray."""
    env = {**os.environ, MARKER: marker_value, "RAY_raylet_start_wait_time_s": "120",
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="rlvla3-", dir="/tmp")}
    env.pop("RAY_ADDRESS", None)
    return env


def kill_marked(marker_value: str) -> int:
    """SIGKILL every marked process (a few rounds: raylets respawn nothing once the GCS is
    gone); returns how many were found."""
    found = 0
    for _ in range(3):
        pids = marked_pids(marker_value)
        if not pids:
            break
        found += len(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(1.0)
    return found


class Facts:
    """The scenarios' results, written out after each one."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict = {}

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def start_cluster():
    import ray
    from ray.cluster_utils import Cluster

    from actors.runtime.bootstrap import NAMESPACE

    start = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}})
    nodes = {name: cluster.add_node(num_cpus=cpus, resources=res)
             for name, (cpus, res) in SHAPE.items()}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    return cluster, nodes, round(time.monotonic() - start, 1)


def node_names(nodes: dict, cluster) -> dict[str, str]:
    names = {n.node_id: name for name, n in nodes.items()}
    names[cluster.head_node.node_id] = "head"
    return names


def where(topo, names: dict[str, str]) -> dict[str, list[str | None]]:
    return {role: [names.get(n, n) for n in ids] for role, ids in topo.nodes().items()}


def scenario_placement(facts: Facts, cluster, nodes, tmp: Path) -> None:
    from actors.rl.controller import Controller
    from rlvla3.config import ConfigError
    from rlvla3.run_config import load_run_config

    names = node_names(nodes, cluster)
    out = {}
    for mode, roles in (("full", ROLES), ("sync", TINY)):  # colocated: on the learner node
        cfg = load_run_config("smoke", overrides=roles + [f"pipeline.mode={mode}"])
        controller = Controller(cfg, tmp / f"placement-{mode}", quiet=True)
        try:
            start = time.monotonic()
            topo = controller.build()
            _wait(lambda t=topo: all(n is not None for ns in t.nodes().values() for n in ns),
                  "every actor running")  # the last env workers may still be starting
            out[mode] = {"placement": cfg.choices.placement, "nodes": where(topo, names),
                         "build_s": round(time.monotonic() - start, 1),
                         "actor_names": {role: list(ns) for role, ns in topo.names.items()}}
        finally:
            controller.shutdown()
    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=sync"])
    try:  # colocated, but the roles ask for learner, rollout and sim: no node has all three
        Controller(cfg, tmp / "refused", quiet=True).build()
        out["refused"] = None
    except ConfigError as exc:
        out["refused"] = {"field": exc.field, "message": str(exc)}
    facts.put("placement", out)


def _run_in_thread(controller) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def go() -> None:
        try:
            result["summary"] = controller.run()
        except BaseException as exc:  # noqa: BLE001 - reported in the facts
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["error_at"] = time.monotonic()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, result


def last_row(run_dir: Path) -> dict:
    """The run's latest progress row (``metrics.jsonl``; empty before the first)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else {}


def _wait(condition, what: str, timeout_s: float = 180.0, run: dict | None = None) -> float:
    """Seconds until ``condition()`` holds; fails after ``timeout_s``, or at once when the run
    (``run``: the result dict of ``_run_in_thread``) ended with an error."""
    start = time.monotonic()
    while not condition():
        if run is not None and run.get("error"):
            raise RuntimeError(f"the run failed while waiting for {what}: {run['error']}")
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.25)
    return round(time.monotonic() - start, 1)


def scenario_sim_node_loss(facts: Facts, cluster, nodes, tmp: Path) -> None:
    import ray

    from actors.rl.controller import Controller
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=full",
                                                      "total_env_steps=100000000"])
    controller = Controller(cfg, tmp / "sim-loss", quiet=True)
    topo = controller.build()
    names = node_names(nodes, cluster)
    thread, result = _run_in_thread(controller)
    out: dict = {"nodes_before": where(topo, names)}
    try:
        steps = lambda: last_row(tmp / "sim-loss").get("env_steps", 0)  # noqa: E731
        _wait(lambda: steps() > 300, "env steps before the loss")
        victim = where(topo, names)["env"][1]
        out["removed"] = victim
        cluster.remove_node(nodes.pop(victim))
        removed_at = time.monotonic()
        out["detected_s"] = _wait(lambda: 1 in controller.capacity.down("env"), "the loss seen")
        before = steps()
        _wait(lambda: steps() > before + 200, "env steps with one env worker")
        row = last_row(tmp / "sim-loss")
        out["row_while_down"] = {k: row.get(k) for k in (
            "env_slots_live", "env_slots_waiting", "actors_down", "restart_counts")}
        out["steps_while_down"] = steps() - before
        nodes["sim2"] = cluster.add_node(num_cpus=1, resources={"sim": 1})
        added_at = time.monotonic()
        out["back_after_add_s"] = _wait(lambda: 1 not in controller.capacity.down("env"),
                                        "the env worker back on the new node")
        out["back_after_loss_s"] = round(time.monotonic() - removed_at, 1)
        _wait(lambda: ray.get(topo.workers[1].stats.remote()).env_steps > 50,
              "the returned env worker stepping")
        out["first_steps_after_add_s"] = round(time.monotonic() - added_at, 1)
        out["nodes_after"] = where(topo, node_names(nodes, cluster))
        controller.request_stop()
        thread.join(timeout=180)
    finally:
        controller.request_stop()
        thread.join(timeout=60)
        controller.shutdown()
    summary = result.get("summary") or {}
    out["error"] = result.get("error")
    out["summary"] = {k: summary.get(k) for k in (
        "env_steps", "env_slots_live", "env_slots_waiting", "outages", "restart_counts",
        "accounting", "lost_segments", "policy_version")}
    facts.put("sim_node_loss", out)


def scenario_rollout_node_loss(facts: Facts, cluster, nodes, tmp: Path) -> None:
    from actors.rl.controller import Controller
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("smoke", overrides=ROLES + ["pipeline.mode=full",
                                                      "total_env_steps=100000000"])
    controller = Controller(cfg, tmp / "rollout-loss", quiet=True)
    controller.build()
    thread, result = _run_in_thread(controller)
    out: dict = {}
    try:
        _wait(lambda: last_row(tmp / "rollout-loss").get("env_steps", 0) > 200,
              "env steps before the loss")
        cluster.remove_node(nodes.pop("rollout"))
        removed_at = time.monotonic()
        thread.join(timeout=cfg.ray.node_wait_s + 120)
        out["stopped"] = not thread.is_alive()
        out["stopped_after_s"] = round(result.get("error_at", time.monotonic()) - removed_at, 1)
        out["error"] = result.get("error")
        out["node_wait_s"] = cfg.ray.node_wait_s
    finally:
        controller.request_stop()
        thread.join(timeout=30)
        controller.shutdown()
    facts.put("rollout_node_loss", out)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def autoscaling_config(gcs: str, max_sim: int) -> dict:
    """A fake-multinode autoscaling config (Ray's ``fake_multinode`` provider starts each node
    as local processes): the head, and ``sim`` nodes from 0 up to ``max_sim``, released after
    6 s idle. cluster.yaml's ``sim_cpu`` type, scaled down."""
    return {
        "cluster_name": "rlvla3-autoscale-test", "max_workers": max_sim, "upscaling_speed": 1.0,
        "idle_timeout_minutes": 0.1,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "gcs_address": gcs},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
            "sim_cpu": {"resources": {"CPU": 1, "sim": 1, "object_store_memory": 100 * 2**20},
                        "node_config": {}, "min_workers": 0, "max_workers": max_sim},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    }


def start_autoscaling_head(tmp: Path, max_sim: int):
    """``ray start --head --block`` with the fake provider (as ``AutoscalingCluster.start`` does,
    but on free ports and without its ``ray stop --force``, which would stop every Ray on the
    machine); returns the process and the GCS address."""
    import subprocess

    import ray._private.services as services

    ip = services.get_node_ip_address()
    port = _free_port()
    gcs = f"{ip}:{port}"
    config = tmp / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(gcs, max_sim)))
    ray_cli = str(Path(sys.executable).parent / "ray")
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    cmd = [ray_cli, "start", "--head", "--block", f"--port={port}", f"--node-ip-address={ip}",
           f"--autoscaling-config={config}", "--num-cpus=2", "--include-dashboard=false",
           f"--dashboard-agent-listen-port={_free_port()}",
           f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
           f"--ray-client-server-port={_free_port()}", f"--metrics-export-port={_free_port()}",
           "--disable-usage-stats"]
    log = open(tmp / "head.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait(lambda: "Ray runtime started" in (tmp / "head.log").read_text(), "the head", 180)
    return proc, gcs


def scenario_autoscaling(facts: Facts, tmp: Path) -> None:
    """Three env workers ask for ``sim`` and no sim node exists: the autoscaler launches them,
    the run starts on the first and uses the others as they arrive; after the run the idle
    nodes are released."""
    import ray

    from actors.observe.status import collect
    from actors.rl.controller import Controller
    from actors.runtime.bootstrap import NAMESPACE
    from rlvla3.run_config import load_run_config

    proc, gcs = start_autoscaling_head(tmp, max_sim=3)
    out: dict = {}
    try:
        ray.init(address=gcs, namespace=NAMESPACE, log_to_driver=False)
        sims = lambda: [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("sim")]  # noqa: E731
        out["sim_nodes_at_start"] = len(sims())
        cfg = load_run_config("smoke", overrides=TINY[:-1] + [
            "pipeline.mode=full", "env_workers.num_workers=3", "env_workers.resources={sim: 1}",
            "total_env_steps=100000000", "ray.placement_timeout_s=240"])
        controller = Controller(cfg, tmp / "autoscale", quiet=True)
        thread, result = _run_in_thread(controller)  # build() happens inside run()
        start = time.monotonic()
        seen_waiting = []
        while (time.monotonic() - start < 240 and not seen_waiting and len(sims()) < 3
               and not result.get("error")):
            rows = [r for r in collect(5.0) if r["run"] == "autoscale"]
            seen_waiting = [r for r in rows if r.get("env_slots_waiting")
                            and r.get("resource_demand") not in (None, "none")]
            time.sleep(0.5)
        out["status_while_waiting"] = {k: seen_waiting[0].get(k) for k in (
            "state", "env_slots_live", "env_slots_waiting", "pending_nodes", "resource_demand")
                                       } if seen_waiting else None
        since = lambda: round(time.monotonic() - start, 1)  # noqa: E731 - from the run's start
        _wait(lambda: len(sims()) >= 1, "a sim node", 240, result)
        out["first_sim_node_s"] = since()
        _wait(lambda: len(sims()) >= 3, "three sim nodes", 240, result)
        out["all_sim_nodes_s"] = since()
        _wait(lambda: last_row(tmp / "autoscale").get("env_slots_live") == 6
              and last_row(tmp / "autoscale").get("env_slots_waiting") == 0,
              "every env slot running", 240, result)
        out["all_slots_running_s"] = since()
        steps = last_row(tmp / "autoscale").get("env_steps", 0)
        _wait(lambda: last_row(tmp / "autoscale").get("env_steps", 0) > steps + 300,
              "env steps on the new nodes", 180, result)
        controller.request_stop()
        thread.join(timeout=180)
        controller.shutdown()
        ended = time.monotonic()
        summary = result.get("summary") or {}
        out["error"] = result.get("error")
        out["env_nodes"] = summary.get("nodes", {}).get("env")
        out["outages"] = summary.get("outages")
        out["start_waits"] = summary.get("start_waits")
        out["released_after_s"] = _wait(lambda: len(sims()) == 0, "the idle nodes released", 180)
        out["released_after_run_s"] = round(time.monotonic() - ended, 1)
    finally:
        ray.shutdown()
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.wait(timeout=60)
    facts.put("autoscaling", out)


def main(out_path: str) -> int:
    facts = Facts(Path(out_path))
    tmp = Path(out_path).parent
    cluster, nodes, started_s = start_cluster()
    facts.put("cluster_start_s", started_s)
    run_scenarios(facts, (scenario_placement, scenario_sim_node_loss, scenario_rollout_node_loss),
                  cluster, nodes, tmp)
    return 0


def run_scenarios(facts: Facts, scenarios, cluster, *args) -> None:
    """Each scenario in turn (one that fails is reported, the next still runs), its duration in
    the facts; then the cluster is shut down."""
    try:
        for scenario in scenarios:
            start = time.monotonic()
            try:
                scenario(facts, cluster, *args)
            except Exception:  # noqa: BLE001 - the next scenarios still run
                facts.put(f"{scenario.__name__}_error", traceback.format_exc())
            facts.put(f"{scenario.__name__}_s", round(time.monotonic() - start, 1))
    finally:
        import ray

        ray.shutdown()
        cluster.shutdown()


def scenario_result(facts: dict, name: str) -> dict:
    """One scenario's facts; a scenario that failed fails the test with its traceback."""
    assert name in facts, facts.get(f"scenario_{name}_error") or facts["_log"]
    return facts[name]


def scenario_facts(script: Path, out: Path, timeout_s: float, show: Callable[[str], bool]
                   ) -> dict:
    """Run a scenario script in a subprocess marked for cleanup (``scenario_env``), kill what
    is left of it, and return its facts (``_log``: the end of its output); prints the facts
    ``show`` picks (``pytest -s`` shows them)."""
    marker = str(out)
    env = scenario_env(marker)
    try:
        proc = subprocess.run([sys.executable, str(script), str(out / "facts.json")], env=env,
                              cwd=REPO, text=True, capture_output=True, timeout=timeout_s)
    finally:
        kill_marked(marker)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    data = json.loads((out / "facts.json").read_text()) if (out / "facts.json").is_file() else {}
    data["_log"] = (proc.stdout + proc.stderr)[-4000:]
    for key, value in data.items():
        if key != "_log" and show(key):
            print(f"{key}: {json.dumps(value, default=str)[:3000]}")
    return data


def main_autoscaling(out_path: str) -> int:
    # `ray start` turns token authentication on; Ray reads these when it is first imported
    token = Path(out_path).parent / "auth_token"
    token.write_text(secrets.token_hex(32))
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    facts = Facts(Path(out_path))
    start = time.monotonic()
    try:
        scenario_autoscaling(facts, Path(out_path).parent)
    except Exception:  # noqa: BLE001 - reported in the facts
        facts.put("scenario_autoscaling_error", traceback.format_exc())
    facts.put("scenario_autoscaling_s", round(time.monotonic() - start, 1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    if sys.argv[1] == "--autoscaling":
        sys.exit(main_autoscaling(sys.argv[2]))
    sys.exit(main(sys.argv[1]))
