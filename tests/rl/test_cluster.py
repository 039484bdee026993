"""Cluster operation: ``cluster.yaml`` under Ray's own validation, the Grafana dashboard against
the series the roles export, and a real ``ray job submit`` of a short RL run to a local head
node with token authentication, watched through ``rlvla3 status``, ``ray list actors`` (every
actor named by run and role), Ray's Prometheus endpoint, and a real Prometheus server that
scrapes the cluster and answers every panel query of the Grafana dashboard.

The head node of the job test is this test's alone: its own temp dir, free ports, its own token
file, and a marker in its environment. It is stopped by signalling its ``ray start --block``
process and then killing, by pid, only processes that carry the marker (``ray stop`` would stop
every Ray process on the machine, including other tests' clusters). Prometheus (the Debian
package ``prometheus``, installed by the README's test command) runs from a temp dir on a free
port and is stopped the same way.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from support.cluster_scenarios import MARKER, marked_pids

from actors.runtime.metrics import _COUNTERS, _GAUGES, _HISTOGRAMS, TAGS

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "actors" / "observe" / "dashboards" / "rlvla3_grafana.json"
EGL_PACKAGES = ("libegl1", "libegl-mesa0", "libgl1-mesa-dri", "libgbm1", "libopengl0", "libgl1",
                "libglib2.0-0")
RAY = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"  # this Python's CLI
UPLOAD_EXCLUDES = ["runs/", ".git/", "**/__pycache__/", ".pytest_cache/", ".ruff_cache/",
                   ".benchmarks/", "*.egg-info/"]


# ---- cluster.yaml ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_config() -> dict:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())


def test_cluster_yaml_passes_ray_validation(cluster_config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cluster_config))  # what `ray up` does first
    validate_config(prepared)
    assert prepared["head_node_type"] == "head"
    assert prepared["available_node_types"]["head"]["max_workers"] == 0
    broken = copy.deepcopy(cluster_config)  # the same validation rejects a malformed node type
    broken["available_node_types"]["sim_cpu"]["resources"]["sim"] = "many"
    with pytest.raises(Exception, match="many"):
        validate_config(prepare_config(broken))


def test_cluster_yaml_node_types(cluster_config):
    types = cluster_config["available_node_types"]
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert {"learner", "rollout"} <= {k for t in gpu.values() for k in t["resources"]}
    sim = [t for t in types.values() if t["resources"].get("sim", 0) > 0]
    assert sim and all(t["resources"].get("GPU", 0) == 0 for t in sim)
    assert types[cluster_config["head_node_type"]]["resources"] == {"CPU": 0}
    for t in gpu.values():  # CUDA torch from PyPI, pinned, and the GPU extras
        setup = " ".join(t["worker_setup_commands"])
        assert "torch==2.13.0" in setup and "whl/cpu" not in setup
        assert '".[libero,gpu]"' in setup
        assert t["docker"]["worker_image"].startswith("rayproject/ray:2.60.0-py311-cu")
    for t in sim:  # software EGL for MuJoCo, CPU torch, the simulator extra
        setup = " ".join(t["worker_setup_commands"])
        assert all(pkg in setup.split() for pkg in EGL_PACKAGES)
        assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in setup
        assert '".[libero]"' in setup
    assert "torch==2.13.0" in " ".join(cluster_config["setup_commands"])
    assert cluster_config["file_mounts"]["~/rlvla3"] == "."
    assert {"runs", ".git"} <= set(cluster_config["rsync_exclude"])


def test_cluster_yaml_dashboard_on_loopback_and_token_auth_on(cluster_config):
    head = " ".join(cluster_config["head_start_ray_commands"])
    assert re.search(r"--dashboard-host[= ]127\.0\.0\.1\b", head)
    text = (REPO / "cluster.yaml").read_text()
    assert "0.0.0.0" not in text
    assert not re.search(r"RAY_AUTH_MODE\s*=\s*['\"]?disabled", text, re.IGNORECASE)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in cluster_config[key] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token" in c for c in starts), key
    assert cluster_config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


# ---- Grafana dashboard -------------------------------------------------------------------------
def exported_series() -> dict[str, str]:
    """Prometheus series name -> metric name in actors/runtime/metrics.py, as Ray 2.60 exports them:
    a ``ray_`` namespace prefix, ``_total`` on counters, ``_bucket/_sum/_count`` on histograms
    (checked against a live endpoint in the job test below)."""
    series = {f"ray_rlvla3_{n}_total": n for n in _COUNTERS}
    series.update({f"ray_rlvla3_{n}": n for n in _GAUGES})
    for n in _HISTOGRAMS:
        series.update({f"ray_rlvla3_{n}_{suffix}": n for suffix in ("bucket", "sum", "count")})
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_dashboard_has_ray_grafana_format(dashboard):
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 27
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["type"] in ("graph", "heatmap", "timeseries", "stat"), p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(set(refs)) == len(refs)


def test_dashboard_queries_reference_exported_series(dashboard):
    series = exported_series()
    variables = {"$__rate_interval", "$SessionName", "$role"}
    used = set()
    for p in dashboard["panels"]:
        for t in p["targets"]:
            expr = t["expr"]
            names = set(re.findall(r"\b(?:ray_)?rlvla3_\w+", expr))
            assert names, f"{p['title']}: {expr} reads no rlvla3 series"
            unknown = names - set(series)
            assert not unknown, f"{p['title']}: {sorted(unknown)} are not exported by actors/runtime/metrics.py"
            used |= {series[n] for n in names}
            for group in re.findall(r"\bby \(([^)]*)\)", expr):
                labels = {x.strip() for x in group.split(",")}
                assert labels <= {*TAGS, "le"}, f"{p['title']}: unknown labels {labels}"
            assert set(re.findall(r"\$\w+", expr)) <= variables, expr
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            if p["type"] == "heatmap":
                assert t.get("format") == "heatmap" and "_bucket" in expr
    assert used == set(_COUNTERS) | set(_GAUGES) | set(_HISTOGRAMS), "metrics without a panel"


# ---- ray job submit against a running head node -------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalHead:
    """A ``ray start --head --block`` on loopback with token auth, owned by one test."""

    def __init__(self, num_cpus: int = 4):
        self.root = Path(tempfile.mkdtemp(prefix="rlvla3-ray-", dir="/tmp"))  # short: socket paths
        self.token = secrets.token_hex(32)
        (self.root / "auth_token").write_text(self.token)
        self.marker = f"{MARKER}={self.root}"
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        # RAY_TMPDIR: every driver that connects writes the cluster's address to
        # <tmp>/ray/ray_current_cluster, which a plain ray.init() elsewhere would follow
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.root / "auth_token"),
                        RLVLA3_TEST_CLUSTER=str(self.root), PYTHONUNBUFFERED="1",
                        RAY_TMPDIR=str(self.root))
        self.port, self.dashboard_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.log = self.root / "head.log"
        cmd = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={self.port}", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}",
               f"--dashboard-agent-listen-port={_free_port()}",
               f"--dashboard-agent-grpc-port={_free_port()}",
               f"--runtime-env-agent-port={_free_port()}",
               f"--ray-client-server-port={_free_port()}",
               f"--metrics-export-port={self.metrics_port}", f"--num-cpus={num_cpus}",
               f"--temp-dir={self.root / 'ray'}", "--disable-usage-stats"]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    @property
    def gcs(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()}")
            if "Ray runtime started" in self.log.read_text():
                try:
                    urllib.request.urlopen(self.http + "/api/version", timeout=5)
                    return
                except urllib.error.HTTPError:  # an answer (e.g. 401): the dashboard serves
                    return
                except OSError:
                    pass
            time.sleep(1.0)
        raise TimeoutError(f"head node not ready after {timeout_s} s:\n{self.log.read_text()}")

    def api(self, path: str, token: str | None = None) -> dict:
        request = urllib.request.Request(self.http + path, headers={
            "Authorization": f"Bearer {self.token if token is None else token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def run(self, *args: str, timeout_s: float = 180.0, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env={**self.env, **env}, cwd=REPO, text=True,
                              capture_output=True, timeout=timeout_s)

    def _marked_pids(self) -> list[int]:
        return marked_pids(str(self.root))

    def stop(self) -> None:
        """SIGTERM the blocking ``ray start`` (it drains and stops its processes), then SIGKILL
        whatever still carries this cluster's marker, by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        for _ in range(3):
            pids = self._marked_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(1.0)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


class Prometheus:
    """A Prometheus server scraping the head's nodes every second, through the service
    discovery file Ray keeps up to date (the file Ray's own generated prometheus.yml reads)."""

    def __init__(self, head: LocalHead):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the Debian package prometheus is not installed (the README's test "
                        "command installs it)")
        self.root = head.root / "prometheus"
        self.root.mkdir()
        self.port = _free_port()
        discovery = head.root / "ray" / "session_latest" / "prom_metrics_service_discovery.json"
        (self.root / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "ray",
                                "file_sd_configs": [{"files": [str(discovery)],
                                                     "refresh_interval": "1s"}]}]}))
        with open(self.root / "prometheus.log", "w") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={self.root / 'prometheus.yml'}",
                 f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                env=head.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{query}"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())

    def targets_up(self) -> int:
        try:
            targets = self.api("targets")["data"]["activeTargets"]
        except OSError:
            return 0
        return sum(t["health"] == "up" for t in targets)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def panel_queries(dashboard: dict, window: str = "15s") -> list[tuple[str, str]]:
    """Every panel query of the dashboard with Grafana's variables filled in: every session
    and role, and a rate window of a few scrapes."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = (target["expr"].replace("$__rate_interval", window)
                    .replace("$SessionName", ".+").replace("$role", ".+"))
            out.append((f"{panel['title']} [{target['refId']}]", expr))
    return out


def _panels_without_data(prometheus: Prometheus, start: float) -> list[str]:
    """The Grafana dashboard's panel queries that return no data over [start, now]."""
    empty = []
    for title, expr in panel_queries(json.loads(DASHBOARD.read_text())):
        answer = prometheus.api("query_range", query=expr, start=str(start),
                                end=str(time.time()), step="2")
        assert answer["status"] == "success", (title, answer)
        if not answer["data"]["result"]:
            empty.append(title)
    return empty


def _status(head: LocalHead, *extra: str) -> subprocess.CompletedProcess:
    return head.run(sys.executable, "-m", "rlvla3", "status", "--address", head.gcs, *extra,
                    timeout_s=120)


def _scrape(head: LocalHead) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{head.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.slow
def test_job_submit_with_token_status_and_metrics(tmp_path):
    run_dir = tmp_path / "runs" / f"smoke-{uuid.uuid4().hex[:6]}"
    job_id = f"rlvla3-test-{uuid.uuid4().hex[:8]}"
    head = LocalHead()
    prometheus = None
    try:
        head.wait_ready()
        prometheus = Prometheus(head)
        # Token auth is on: the jobs API turns away a wrong token.
        with pytest.raises(urllib.error.HTTPError) as denied:
            head.api("/api/jobs/", token=secrets.token_hex(32))
        assert denied.value.code in (401, 403)
        submit = head.run(
            RAY, "job", "submit", "--address", head.http, "--submission-id", job_id,
            "--no-wait", "--working-dir", ".",
            # `ray job stop` gives the driver this long to finish after its SIGTERM
            "--runtime-env-json", json.dumps({"excludes": UPLOAD_EXCLUDES,
                                              "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}}),
            "--", "python", "-m", "rlvla3", "rl", "--preset", "smoke", "--run-dir", str(run_dir),
            # runs until `ray job stop` (max_minutes only in case the stop never lands)
            "--set", "total_env_steps=100000000", "--set", "max_minutes=4",
            "--set", "log_every_s=1.0")
        assert submit.returncode == 0, submit.stdout + submit.stderr

        live, scraped, table, actors, killed, stopped = None, "", "", {}, None, None
        started = time.time()
        timeline = {}  # seconds after submission (-s shows them)
        deadline = time.monotonic() + 480
        while time.monotonic() < deadline:
            state = head.api(f"/api/jobs/{job_id}")["status"]
            if state in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            if (state == "RUNNING" and killed is not None and stopped is None
                    and not _panels_without_data(prometheus, started)):
                # seen all there is to see: stop the job as a user would
                stopped = head.run(RAY, "job", "stop", job_id, "--address", head.http, "--no-wait")
                assert stopped.returncode == 0, stopped.stdout + stopped.stderr
                timeline["stop_sent"] = round(time.time() - started, 1)
            if state == "RUNNING" and live is None:
                out = _status(head, "--json")
                assert out.returncode == 0, out.stderr
                rows = {r["run"]: r for r in json.loads(out.stdout)}
                row = rows.get(run_dir.name)
                if row and row["state"] == "running" and row.get("env_steps", 0) > 0:
                    live = row
                    timeline["running"] = round(time.time() - started, 1)
                    table = _status(head).stdout
                    actors = _run_actors(head, run_dir.name)
                    if actors.get("env"):  # a restart and lost episodes for the panels
                        killed = _kill_actor(head, actors["env"][0])
            if state == "RUNNING" and "ray_rlvla3_env_steps_total" not in scraped:
                with contextlib.suppress(OSError):
                    scraped = _scrape(head)
            time.sleep(2.0)
        timeline["ended"] = round(time.time() - started, 1)
        print(f"job timeline: {timeline}")
        logs = head.run(RAY, "job", "logs", job_id, "--address", head.http)
        assert stopped is not None, f"the run never showed every panel:\n{logs.stdout[-4000:]}"
        assert state == "STOPPED", f"job ended {state}:\n{logs.stdout[-4000:]}{logs.stderr}"
        # SIGTERM ended the run as a budget would: last step, checkpoint, summary
        assert "SIGTERM: stopping after the current step" in logs.stdout + logs.stderr
        assert "stopped by SIGTERM; summary:" in logs.stdout

        # The live status seen while the job ran.
        assert live is not None, "rlvla3 status never showed the run while it ran"
        assert live["mode"] == "full" and live["run_dir"] == str(run_dir)
        for key in ("env_steps_per_s", "queue_depth", "policy_version", "busy_env",
                    "busy_rollout", "busy_learner", "dropped", "restarts", "age_s"):
            assert key in live, key
        assert live["env_steps_per_s"] > 0
        assert run_dir.name in table and "env steps/s" in table and "queue depth" in table

        # Ray's Prometheus endpoint carries the series the dashboard reads, with their tags.
        assert re.search(r'ray_rlvla3_env_steps_total\{[^}]*actor_id="env-0"', scraped)
        assert re.search(r'ray_rlvla3_env_steps_total\{[^}]*role="env"', scraped)
        exported = set(re.findall(r"^(ray_rlvla3_\w+)[{ ]", scraped, re.MULTILINE))
        series = exported_series()
        assert exported - set(series) <= {f"ray_rlvla3_{n}" for n in _COUNTERS}, \
            exported - set(series)  # only the deprecated counter-as-gauge twins are extra
        assert {"ray_rlvla3_trajectories_total", "ray_rlvla3_requests_total",
                "ray_rlvla3_batch_size_bucket", "ray_rlvla3_queue_depth"} <= exported

        # The run directory the job wrote.
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["run_dir"] == str(run_dir) and summary["env_steps"] > 0
        assert summary["stopped_by"] == "SIGTERM"  # `ray job stop`, not a budget
        assert "budget: 100000000 env steps (total_env_steps) or 4 min" in logs.stdout
        assert (run_dir / "config.yaml").is_file() and (run_dir / "metrics.jsonl").is_file()
        assert any((run_dir / "checkpoints").iterdir())

        # Every actor of the run is named by run, role and index: `ray list actors` (the state
        # API behind the dashboard's actor list and logs view) filters them by run and role.
        assert set(actors) == {"learner", "rollout", "env", "queue"}, actors
        assert [len(actors[r]) for r in ("learner", "rollout", "env", "queue")] == [1, 1, 2, 1]
        assert killed is not None and killed.returncode == 0, killed and killed.stderr
        assert summary["restart_counts"]["env_worker"] >= 1

        # A real Prometheus scraped the cluster during the run: every panel query of the
        # Grafana dashboard returns data over the run's time window.
        assert prometheus.targets_up() >= 1, (prometheus.root / "prometheus.log").read_text()
        empty = _panels_without_data(prometheus, started)
        assert not empty, f"panel queries without data: {empty}"

        # The finished run took its status actor with it.
        after = _status(head, "--json")
        assert after.returncode == 0 and run_dir.name not in {r["run"] for r in json.loads(after.stdout)}
    finally:
        if prometheus is not None:
            prometheus.stop()
        head.stop()
    assert not head._marked_pids(), "processes of the test cluster survived"


ACTOR_NAME = re.compile(r"^rlvla3:(?P<run>.+):(?P<uid>[0-9a-f]{6}):(?P<role>[a-z]+)(?P<index>\d+)$")


def _run_actors(head: LocalHead, run: str, roles: int = 4) -> dict[str, list[str]]:
    """The live actors of ``run`` by role, from ``ray list actors`` (the state API; asked again
    for a while until every role shows, since an actor may still be starting)."""
    deadline = time.monotonic() + 90
    while True:
        out = head.run(RAY, "list", "actors", "--address", head.http, "--filter", "state=ALIVE",
                       "--format", "json", "--limit", "10000", timeout_s=120)
        assert out.returncode == 0, out.stdout + out.stderr
        found: dict[str, list[str]] = {}
        start = out.stdout.find("[")  # the CLI prints "No resource in the cluster" for none
        for actor in json.loads(out.stdout[start:]) if start >= 0 else []:
            match = ACTOR_NAME.match(actor.get("name") or "")
            if match and match["run"] == run:
                found.setdefault(match["role"], []).append(actor["name"])
        if len(found) >= roles or time.monotonic() > deadline:
            return {role: sorted(names) for role, names in found.items()}
        time.sleep(2.0)


def _kill_actor(head: LocalHead, name: str) -> subprocess.CompletedProcess:
    """Kill one actor of the cluster by name (Ray restarts it), from a second driver."""
    code = (f"import ray; ray.init(address='{head.gcs}', namespace='rlvla3'); "
            f"ray.kill(ray.get_actor('{name}'), no_restart=False)")
    return head.run(sys.executable, "-c", code, timeout_s=120)
