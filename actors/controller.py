"""The controller: the one place that knows the topology of an RL run.

It validates the run config against the env and policy registries and the cluster's resources
before any actor starts, places the roles (colocated: one shared bundle; disaggregated: a bundle
per actor), creates the actors, syncs initial weights, and then lets the chosen strategies drive
them while it monitors: progress line, TensorBoard scalars, ``metrics.jsonl``, checkpoints, and
``summary.json`` at the end.

Run directory: ``config.yaml`` (resolved config), ``metrics.jsonl``, ``tb/`` (TensorBoard),
``checkpoints/`` and ``summary.json``. Resuming from a run directory restores weights, optimizer
state, policy version and counters, and continues towards the same ``total_env_steps``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import ray
import yaml
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.env_worker import EnvWorker
from actors.learner import Learner
from actors.rollout_server import RolloutServer
from actors.run_status import NAME_PREFIX, NAMESPACE, RunStatus
from actors.strategies import ROLLOUT_STRATEGIES, TRAINING_STRATEGIES
from actors.trajectory_queue import TrajectoryQueue
from envs import env_spec
from rlvla3.checkpoint import read_meta, resolve_checkpoint
from rlvla3.config import ConfigError, require, to_dict
from rlvla3.policies import build_policy
from rlvla3.run_config import RunConfig, check_resources
from rlvla3.types import EnvSpec

CARRIED = ("env_steps", "decisions", "episodes", "successes", "dropped_faults",
           "dropped_decisions", "shipped_decisions", "env_busy_s")


def check_components(cfg: RunConfig) -> EnvSpec:
    """Validate env and policy options through their registries; return the env spec."""
    spec = env_spec(cfg.env)
    for ids, name, bound in ((cfg.env_workers.task_ids, "env_workers.task_ids", spec.num_tasks),
                             (cfg.env_workers.init_state_ids, "env_workers.init_state_ids",
                              spec.num_init_states),
                             (cfg.eval_init_state_ids, "eval_init_state_ids", spec.num_init_states)):
        bad = [i for i in ids if not 0 <= i < bound]
        require(not bad, name, f"ids {bad} out of range 0..{bound - 1}")
    build_policy(cfg.policy, spec)
    if cfg.init_from:
        try:
            meta = read_meta(cfg.init_from)
        except FileNotFoundError as exc:
            raise ConfigError("init_from", str(exc)) from None
        require(meta.policy.name == cfg.policy.name, "init_from",
                f"the checkpoint holds a {meta.policy.name!r} policy, not {cfg.policy.name!r}")
        require(meta.spec.action_dim == spec.action_dim and meta.spec.cameras == spec.cameras,
                "init_from", f"the checkpoint was trained for {meta.spec}, this env is {spec}")
    return spec


def ensure_ray(cfg: RunConfig, log_to_driver: bool = True) -> float:
    """Connect to the configured cluster or start a local one; return its CPU count.
    ``log_to_driver=False`` keeps the actors' output off this process's stdout (JSON output).

    A local Ray gets at least as many logical CPUs as the roles ask for (env workers mostly
    wait on simulators), but the learners are checked against the physical cores."""
    physical = float(os.cpu_count() or 1)
    if not ray.is_initialized():
        address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=log_to_driver)
        else:
            check_resources(cfg, physical, learners_only=True)
            need = (cfg.learner.num_learners * cfg.learner.num_cpus
                    + cfg.rollout.num_servers * cfg.rollout.num_cpus
                    + cfg.env_workers.num_workers * cfg.env_workers.num_cpus)
            cpus = cfg.ray.num_cpus or max(int(physical), int(need + 0.999))
            ray.init(num_cpus=cpus, namespace=NAMESPACE, include_dashboard=False,
                     log_to_driver=log_to_driver, configure_logging=False)
    return float(ray.cluster_resources().get("CPU", physical))


@dataclass
class Topology:
    """The actors of one run."""

    queue: object
    servers: list
    learners: list
    workers: list
    pg: object = None
    extra: dict = field(default_factory=dict)


class Controller:
    """Builds and runs one RL run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: bool = False,
                 quiet: bool = False):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.resume = resume
        self.quiet = quiet
        self.spec = check_components(cfg)
        self.strategies = cfg.strategies
        self.rollout = ROLLOUT_STRATEGIES[self.strategies.rollout]()
        self.training = TRAINING_STRATEGIES[self.strategies.training]()
        self.topology: Topology | None = None
        self.counters = {"env_steps": 0, "episodes": 0, "wall_s": 0.0}
        self.restarts = {"env_worker": 0, "rollout_server": 0, "learner": 0, "episodes_lost": 0}
        self._incarnations: dict[tuple[str, int], dict] = {}
        self._eval: tuple | None = None
        self._last_eval_version = 0
        self._saved: tuple[int, dict, str] | None = None  # (version, counters, path) last written
        self.evals: list[dict] = []
        self._tb = None
        self._history: list[dict] = []

    # ---- topology ------------------------------------------------------------------------
    def _placement(self, demands: list[dict]) -> tuple[object, list]:
        """One scheduling strategy per actor, from the placement strategy."""
        if self.strategies.placement == "colocated":
            total: dict[str, float] = {}
            for d in demands:
                for k, v in d.items():
                    total[k] = total.get(k, 0.0) + v
            bundles, index = [{k: v for k, v in total.items() if v > 0} or {"CPU": 0.01}], \
                [0] * len(demands)
            strategy = "STRICT_PACK"
        else:
            bundles = [{k: v for k, v in d.items() if v > 0} or {"CPU": 0.01} for d in demands]
            index = list(range(len(demands)))
            strategy = "PACK"
        pg = placement_group(bundles, strategy=strategy)
        ray.get(pg.ready(), timeout=120)
        return pg, [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                    for i in index]

    def build(self) -> Topology:
        cfg, spec = self.cfg, self.spec
        cpus = ensure_ray(cfg)
        if cfg.ray.address or os.environ.get("RAY_ADDRESS"):
            check_resources(cfg, cpus)
        lc, rc, ec = cfg.learner, cfg.rollout, cfg.env_workers
        demands = ([{"CPU": lc.num_cpus, "GPU": lc.num_gpus}] * lc.num_learners
                   + [{"CPU": rc.num_cpus, "GPU": rc.num_gpus}] * rc.num_servers
                   + [{"CPU": ec.num_cpus}] * ec.num_workers)
        pg, sched = self._placement(demands)
        learner_sched = sched[:lc.num_learners]
        server_sched = sched[lc.num_learners:lc.num_learners + rc.num_servers]
        worker_sched = sched[lc.num_learners + rc.num_servers:]

        # Fault tolerance: Ray restarts a crashed role and re-sends its in-flight calls; a
        # restarted server pulls the newest weights from learner 0 (found by name), a restarted
        # learner restores the last checkpoint. A DDP group cannot re-form around one new rank,
        # so learners restart only when there is one.
        learner0 = f"rlvla3-learner0:{self.run_dir.name}:{uuid.uuid4().hex[:8]}"
        queue = ray.remote(TrajectoryQueue).options(num_cpus=0, max_concurrency=1000).remote(cfg.queue)
        servers = [
            ray.remote(RolloutServer).options(
                num_cpus=rc.num_cpus, num_gpus=rc.num_gpus, max_concurrency=10_000,
                scheduling_strategy=server_sched[i],
                max_restarts=-1 if lc.weight_sync == "object_store" else 0,
                max_task_retries=-1 if lc.weight_sync == "object_store" else 0,
            ).remote(i, cfg.policy, spec, rc, cfg.seed, learner0)
            for i in range(rc.num_servers)
        ]
        single = lc.num_learners == 1
        learners = [
            ray.remote(Learner).options(
                num_cpus=lc.num_cpus, num_gpus=lc.num_gpus, max_concurrency=4,
                scheduling_strategy=learner_sched[r], max_restarts=-1 if single else 0,
                max_task_retries=-1 if single else 0,
                **({"name": learner0, "namespace": NAMESPACE} if r == 0 else {}),
            ).remote(r, lc.num_learners, cfg.policy, spec, cfg.algo, lc, self.strategies.learner,
                     cfg.seed, servers, queue, str(self.run_dir))
            for r in range(lc.num_learners)
        ]
        addr, port = ray.get(learners[0].address.remote())
        ray.get([lr.init_group.remote(addr, port) for lr in learners])
        if lc.weight_sync == "collective":
            addr, port = ray.get(learners[0].address.remote())
            world = 1 + len(servers)
            backend = "nccl" if lc.num_gpus > 0 and rc.num_gpus > 0 else "gloo"
            ray.get([learners[0].open_weight_channel.remote(addr, port, world, backend)]
                    + [s.open_weight_channel.remote(addr, port, i + 1, world, backend)
                       for i, s in enumerate(servers)])
        task_ids = list(ec.task_ids) or list(range(spec.num_tasks))
        init_ids = list(ec.init_state_ids) or [
            i for i in range(spec.num_init_states) if i not in set(cfg.eval_init_state_ids)]
        repeat = cfg.algo.group_size if cfg.algo.name == "grpo" else 1
        workers = [
            ray.remote(EnvWorker).options(
                num_cpus=ec.num_cpus, max_concurrency=1000, scheduling_strategy=worker_sched[w],
                max_restarts=-1, max_task_retries=-1,
            ).remote(w, cfg.env, spec, ec, task_ids, init_ids, cfg.seed, repeat, servers, queue)
            for w in range(ec.num_workers)
        ]
        status = ray.remote(RunStatus).options(
            name=NAME_PREFIX + self.run_dir.name, namespace=NAMESPACE, num_cpus=0,
            get_if_exists=True,
        ).remote(self.run_dir.name, str(self.run_dir), cfg.pipeline.mode)
        self.topology = Topology(queue, servers, learners, workers, pg, {"status": status})
        self._sync_initial_weights()
        return self.topology

    def _sync_initial_weights(self) -> None:
        topo = self.topology
        if self.resume:
            ckpt = str(resolve_checkpoint(self.run_dir))
            ray.get([lr.restore.remote(ckpt) for lr in topo.learners])
            self.counters.update(read_meta(ckpt).counters)
        elif self.cfg.init_from:
            ckpt = str(resolve_checkpoint(self.cfg.init_from))
            ray.get([lr.load_weights.remote(ckpt) for lr in topo.learners])
        message = ray.get(topo.learners[0].weights_message.remote())
        ref = ray.put(message)
        ray.get([s.load_weights_now.remote(ref) for s in topo.servers])
        topo.queue.set_version.remote(message.version)

    # ---- running -------------------------------------------------------------------------
    def run(self) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        topo = self.topology or self.build()
        self._log(f"rlvla3 rl: mode={self.cfg.pipeline.mode} strategies={self.strategies} "
                  f"env={self.cfg.env.name} policy={self.cfg.policy.name} run_dir={self.run_dir}")
        self._start = time.monotonic()
        self._base = dict(self.counters)
        self._last_ckpt_version = ray.get(topo.learners[0].version.remote())
        next_log = time.monotonic()
        if self.training.concurrent:
            self.training.start(topo.learners)
            self.rollout.start(topo.workers, topo.servers)
            while not self._done():
                time.sleep(0.2)
                self._check_errors()
                if time.monotonic() >= next_log:
                    self._tick()
                    next_log = time.monotonic() + self.cfg.log_every_s
            self.training.stop(topo.learners)
            ray.get(topo.queue.close.remote())
            self.rollout.stop(topo.workers)
        else:
            while not self._done():
                self.rollout.run_round(topo.workers, topo.servers)
                self.training.after_round(topo.learners, topo.queue, self.cfg.learner.global_batch,
                                          self.spec.max_decisions)
                if time.monotonic() >= next_log:
                    self._tick()
                    next_log = time.monotonic() + self.cfg.log_every_s
        summary = self._tick(final=True)
        self._checkpoint(force=True)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._log(f"summary: {self.run_dir / 'summary.json'}")
        return summary

    def _check_errors(self) -> None:
        if getattr(self.rollout, "errors", None):
            raise self.rollout.errors[0]
        ready, _ = ray.wait(self.training.refs + getattr(self.rollout, "refs", []), timeout=0)
        for ref in ready:
            ray.get(ref)  # a role that ended early ended by an exception: raise it here

    def _role_stats(self, role: str, handles: list, carried: tuple[str, ...] = ()) -> list[dict]:
        """Stats of one role's actors, counting restarts: an actor that Ray restarted reports a
        new incarnation and starts its counters from zero; ``carried`` counters of earlier
        incarnations are added back so totals never go down."""
        stats = ray.get([h.stats.remote() for h in handles])
        out = []
        for i, st in enumerate(stats):
            seen = self._incarnations.get((role, i))
            if seen is not None and seen["incarnation"] != st["incarnation"]:
                self.restarts[role] += 1
                if role == "env_worker":  # the slots' in-flight episodes died with the worker
                    self.restarts["episodes_lost"] += seen["last"]["slots"]
                for key in carried:
                    seen["carry"][key] = seen["carry"].get(key, 0) + seen["last"][key]
            carry = seen["carry"] if seen is not None else {}
            self._incarnations[(role, i)] = {"incarnation": st["incarnation"], "last": st,
                                             "carry": carry}
            out.append({**st, **{k: st[k] + carry.get(k, 0) for k in carried}})
        return out

    def _worker_stats(self) -> list[dict]:
        return self._role_stats("env_worker", self.topology.workers, CARRIED)

    def _env_steps(self) -> int:
        return self._base["env_steps"] + sum(s["env_steps"] for s in self._worker_stats())

    def _done(self) -> bool:
        elapsed = time.monotonic() - self._start
        if self.cfg.max_minutes and (self._base["wall_s"] + elapsed) / 60 >= self.cfg.max_minutes:
            return True
        return self._env_steps() >= self.cfg.total_env_steps

    def _tick(self, final: bool = False) -> dict:
        topo = self.topology
        workers = self._worker_stats()
        servers = self._role_stats("rollout_server", topo.servers, ("requests", "batches"))
        learners = self._role_stats("learner", topo.learners)
        history = ray.get(topo.learners[0].take_history.remote())
        queue = ray.get(topo.queue.stats.remote())
        elapsed = time.monotonic() - self._start
        env_steps = sum(w["env_steps"] for w in workers)
        episodes = sum(w["episodes"] for w in workers)
        recent = [w for w in workers if w["recent_episodes"]]
        weight = sum(w["recent_episodes"] for w in recent) or 1
        sizes: dict[int, int] = {}
        for s in servers:
            for k, v in s["batch_sizes"].items():
                sizes[int(k)] = sizes.get(int(k), 0) + v
        requests = sum(s["requests"] for s in servers)
        batches = sum(s["batches"] for s in servers)
        row = {
            "time_s": round(elapsed, 2),
            "env_steps": self._base["env_steps"] + env_steps,
            "env_steps_per_s": env_steps / max(elapsed, 1e-9),
            "trajectories_per_s": episodes / max(elapsed, 1e-9),
            "episodes": self._base["episodes"] + episodes,
            "episode_return": sum(w["recent_return"] * w["recent_episodes"] for w in recent) / weight,
            "success_rate": sum(w["recent_success"] * w["recent_episodes"] for w in recent) / weight,
            "policy_version": learners[0]["version"],
            "mean_batch_size": requests / batches if batches else 0.0,
            "mean_batch_wait_ms": sum(s["mean_batch_wait_ms"] for s in servers) / len(servers),
            "queue_depth": queue["depth"],
            "dropped_stale": queue["dropped_stale"],
            "dropped_faults": sum(w["dropped_faults"] for w in workers),
            "lost_segments": sum(lr["lost_segments"] for lr in learners),
            "restarts": sum(w["restarts"] for w in workers) + sum(
                v for k, v in self.restarts.items() if k != "episodes_lost"),
            "restart_counts": {**self.restarts,
                               "simulator": sum(w["restarts"] for w in workers)},
            "busy_env": sum(w["busy_fraction"] for w in workers) / len(workers),
            "busy_rollout": sum(s["busy_fraction"] for s in servers) / len(servers),
            "busy_learner": sum(lr["busy_fraction"] for lr in learners) / len(learners),
            "learner_data_wait": sum(lr["data_wait_fraction"] for lr in learners) / len(learners),
            "loss": learners[0].get("loss", float("nan")),
            "staleness": learners[0].get("staleness", float("nan")),
        }
        self.counters.update(env_steps=row["env_steps"], episodes=row["episodes"],
                             wall_s=self._base["wall_s"] + elapsed)
        topo.extra["status"].update.remote(row, "finished" if final else "running")
        self._history.extend(history)
        self._write_metrics(row, history)
        self._log(
            f"[{elapsed:7.1f}s] steps {row['env_steps']:>8} ({row['env_steps_per_s']:6.1f}/s) "
            f"ep {row['episodes']:>5} return {row['episode_return']:6.2f} "
            f"success {row['success_rate']:.2f} v{row['policy_version']} "
            f"batch {row['mean_batch_size']:5.1f} queue {row['queue_depth']:>3} "
            f"busy env/roll/learn {row['busy_env']:.2f}/{row['busy_rollout']:.2f}/"
            f"{row['busy_learner']:.2f} wait {row['learner_data_wait']:.2f}")
        if not final:
            self._checkpoint()
            self._collect_eval()
            self._maybe_start_eval(row["policy_version"])
            return row
        self._collect_eval(wait_s=600.0)
        self._maybe_start_eval(row["policy_version"], final=True)
        self._collect_eval(wait_s=600.0)
        return {
            **row,
            "mode": self.cfg.pipeline.mode,
            "strategies": self.strategies.__dict__,
            "env": self.cfg.env.name,
            "policy": self.cfg.policy.name,
            "algo": self.cfg.algo.name,
            "env_slots": sum(w["slots"] for w in workers),
            "batch_size_hist": dict(sorted(sizes.items())),
            "staleness_hist": queue["staleness_hist"],
            "evals": self.evals,
            "wall_s": self.counters["wall_s"],
            "run_dir": str(self.run_dir),
        }

    def _write_metrics(self, row: dict, history: list[dict]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        step = row["env_steps"]
        for key, value in row.items():
            if isinstance(value, (int, float)) and key != "env_steps":
                self._tb.add_scalar(f"run/{key}", value, step)
        for h in history:
            for key, value in h.items():
                if key != "version":
                    self._tb.add_scalar(f"learner/{key}", value, h["version"])
        self._tb.flush()

    def _checkpoint(self, force: bool = False) -> str | None:
        every = self.cfg.checkpoint_every
        version = ray.get(self.topology.learners[0].version.remote())
        if self._saved and self._saved[:2] == (version, self.counters):
            return self._saved[2]  # e.g. the final eval's snapshot is the final checkpoint
        if force or (every and version - self._last_ckpt_version >= every):
            path = ray.get(self.topology.learners[0].save.remote(str(self.run_dir),
                                                                   dict(self.counters)))
            self._last_ckpt_version = version
            self._saved = (version, dict(self.counters), path)
            return path
        return None

    # ---- periodic evaluation on held-out initial states ----------------------------------
    def _maybe_start_eval(self, version: int, final: bool = False) -> None:
        """Every ``eval_every`` versions: snapshot the weights and evaluate them deterministically
        on ``eval_init_state_ids`` of every training task in a separate actor, without pausing
        training; the result is collected by a later tick. At the end of the run (``final``) the
        last policy is evaluated too unless that version already was."""
        cfg = self.cfg
        due = 1 if final else cfg.eval_every
        if (not cfg.eval_every or not cfg.eval_init_state_ids or self._eval is not None
                or version - self._last_eval_version < due):
            return
        from actors.eval_worker import ActionSource, EvalWorker

        path = self._checkpoint(force=True)
        worker = ray.remote(EvalWorker).options(num_cpus=0).remote(
            cfg.env, ActionSource("checkpoint", path), cfg.seed)
        tasks = list(cfg.env_workers.task_ids) or list(range(self.spec.num_tasks))
        refs = [worker.run_episode.remote(t, s) for t in tasks for s in cfg.eval_init_state_ids]
        self._eval = (version, worker, refs)
        self._last_eval_version = version

    def _collect_eval(self, wait_s: float = 0.0) -> dict | None:
        if self._eval is None:
            return None
        version, worker, refs = self._eval
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        if len(ready) < len(refs):
            return None
        outcomes = ray.get(refs)
        ray.kill(worker)
        self._eval = None
        result = {"version": version, "episodes": len(outcomes),
                  "success_rate": sum(o.success for o in outcomes) / len(outcomes)}
        self.evals.append(result)
        self._log(f"eval at v{version}: success {result['success_rate']:.2f} "
                  f"over {len(outcomes)} held-out episodes")
        if self._tb is not None:
            self._tb.add_scalar("eval/success_rate", result["success_rate"], version)
        return result

    def _log(self, text: str) -> None:
        if not self.quiet:
            print(text, file=sys.stdout, flush=True)

    # ---- teardown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        topo = self.topology
        if topo is None:
            return
        if self._eval is not None:
            ray.kill(self._eval[1])
            self._eval = None
        for w in topo.workers:
            try:
                ray.get(w.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        for lr in topo.learners:
            try:
                ray.get(lr.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001
                pass
        for handle in [*topo.workers, *topo.learners, *topo.servers, topo.queue,
                       *topo.extra.values()]:
            ray.kill(handle)
        if topo.pg is not None:
            remove_placement_group(topo.pg)
        if self._tb is not None:
            self._tb.close()
        self.topology = None
