"""The controller: runs one RL run from a validated config to its summary.

One module over 400 lines because its loop, tick and teardown share one run's state (topology,
monitor, checkpointer, learner group); what has a seam lives beside it: the limits in
``actors.rl.budget``, the summary's pure figures in ``actors.rl.summary``.

It validates the run config against the env and policy registries (``actors.rl.startup``, which
also starts or joins the Ray it runs on), and runs the pre-flight
(every role fits a node, ``rlvla3.plan.cluster``; every node's memory holds its share,
``rlvla3.plan.memory``) before any actor starts, then holds one collaborator per job: the
``Topology`` (which actors exist and where, ``actors.rl.topology``) with its ``LearnerGroup``
(rebuilt when a rank is lost, ``actors.roles.learner_group``), the schedule that drives them and
owns the run's loop (``actors.rl.schedule``: synchronous or asynchronous, with its rollout
driver, ``actors.rl.drivers``, and the stop sequence of an asynchronous run), the ``RunMonitor`` (progress rows, accounting,
``actors.observe.monitor``), the ``CapacityWatch`` (actors that lost their node,
``actors.rl.capacity``), the ``Checkpointer`` (``actors.rl.checkpointer``), ``PeriodicEval``
(``actors.rl.periodic_eval``), ``LearnerFailures`` (whether a learner error rebuilds the group
or ends the run, ``actors.rl.failures``), the ``StepLog`` (per-step objective figures,
``actors.rl.step_log``) and the ``RunBudget`` (when the run stops, ``actors.rl.budget``). The
schedule calls back into it (``actors.rl.schedule.Run``): whether the run is done, a progress
tick when one is due, and what to do about a lost learner or lost capacity. A tick is a
sequence of named steps (``_tick``).

Run directory (a local path or URI, ``rlvla3.checkpoint.storage``): ``config.yaml`` (resolved config),
``metrics.jsonl``, ``steps.jsonl`` (one line per optimizer step), ``tb/`` (TensorBoard),
``checkpoints/`` (written by learner rank 0 wherever it runs) and ``summary.json``; files that
grow are written to a working copy here and copied to a remote storage every
``storage.sync_every_s`` and at the end. Resuming from a run directory
restores weights, optimizer state, policy version, counters and the env workers' episode
samplers, and continues towards the same ``total_env_steps``. A resumed run's summary counts
the whole run (env steps, episodes, trained env steps, decisions) and gives this leg's own
figures in ``this_leg``; its rates and accounting are this leg's.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TypeVar

import ray
import yaml

from actors.observe.collect import WaitingForActors
from actors.observe.figures import RUN_COUNTERS, episode_lengths, staleness_hist, waiting_on
from actors.observe.monitor import RunMonitor, say
from actors.rl.budget import RunBudget
from actors.rl.capacity import CapacityWatch
from actors.rl.checkpointer import Checkpointer, restore_samplers
from actors.rl.failures import LOSS_GRACE_S, LearnerFailures
from actors.rl.periodic_eval import PeriodicEval
from actors.rl.schedule import make_schedule
from actors.rl.startup import check_components, ensure_ray
from actors.rl.step_log import StepLog
from actors.rl.summary import (
    batch_size_hist,
    groups_by_task_line,
    learner_group,
    learner_line,
    memory_report,
    split_note,
)
from actors.rl.topology import Topology, build_topology
from rlvla3.checkpoint.files import read_meta
from rlvla3.checkpoint.storage import Mirror, basename, check_reach, join
from rlvla3.checkpoint.trust import locate_checkpoint
from rlvla3.config import to_dict
from rlvla3.plan.cluster import actor_specs, check_placement, place
from rlvla3.plan.memory import MemoryPlan, choose_sharding, estimate, model_facts
from rlvla3.queue.pacing import group_rounds, inherent_lag
from rlvla3.role_stats import Snapshot
from rlvla3.run_config import RunConfig
from rlvla3.types import WeightsMessage

T = TypeVar("T")


def _built(part: T | None) -> T:
    """A part of the run that ``Controller.build`` makes and ``shutdown`` drops."""
    if part is None:
        raise RuntimeError("the run's actors are not built (Controller.build) or were shut down")
    return part


class Controller:
    """Builds and runs one RL run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, resume: bool = False,
                 quiet: bool = False):
        self.cfg = cfg
        self.files = Mirror(str(run_dir), keep=("metrics.jsonl", "steps.jsonl") if resume else (),
                            every_s=cfg.storage.sync_every_s)
        self.run_dir = self.files.local
        """The run directory's working copy on this machine (itself, for a local storage)."""
        self.resume = resume
        self.quiet = quiet
        self.spec = check_components(cfg)
        self.choices = cfg.choices
        self.schedule = make_schedule(cfg, self.spec)
        self._topology: Topology | None = None
        self._monitor: RunMonitor | None = None
        self.evaluator = PeriodicEval(cfg, self.spec.num_tasks)
        self.counters: dict = {**dict.fromkeys(RUN_COUNTERS, 0), "wall_s": 0.0}
        self.partial_counters: list[str] = []
        """Whole-run counts a resumed checkpoint lacked (saved before they were kept): they
        count from this leg."""
        self.samplers_continued = 0
        """Env workers that continued a resumed run's episode sequence."""
        self._watchdog_stop = threading.Event()
        self._capacity: CapacityWatch | None = None
        self._down_workers: set[int] = set()
        self.budget = RunBudget(cfg, self.log)
        self.stopped_by: str | None = None  # the limit that ended the run
        self.failures = LearnerFailures(cfg.learner.max_rebuilds, cfg.learner.rebuild_window_s)
        self.stop_record: dict | None = None  # how an asynchronous run's stop went

    @property
    def evals(self) -> list[dict]:
        return self.evaluator.results

    # ---- topology ------------------------------------------------------------------------
    def build(self) -> Topology:
        ensure_ray(self.cfg)
        self.check_storage()
        self.memory_plan = self._preflight()  # resolves learner.sharding: auto
        cfg = self.cfg
        topology = build_topology(cfg, self.spec, self.files.uri, basename(self.files.uri),
                                  self.schedule.concurrent)
        self._topology = topology
        self._monitor = RunMonitor(topology, self.run_dir)
        demands = {a.role: dict(a.resources) for a in actor_specs(cfg)}
        self._capacity = CapacityWatch(topology, demands,
                                       lockstep=self.choices.rollout != "async",
                                       wait_s=cfg.ray.node_wait_s)
        self._sync_initial_weights()
        return topology

    @property
    def topology(self) -> Topology:
        return _built(self._topology)

    @property
    def monitor(self) -> RunMonitor:
        return _built(self._monitor)

    @property
    def capacity(self) -> CapacityWatch:
        return _built(self._capacity)

    def check_storage(self) -> None:
        """Before any actor starts: a local storage path is refused on a cluster of more than
        one node unless declared shared (``rlvla3.checkpoint.storage.check_reach``)."""
        from actors.runtime.cluster_state import alive_nodes, autoscaler

        check_reach(self.files.uri, self.cfg.storage.shared, len(alive_nodes()),
                    autoscaler() is not None, "storage.root")

    def _preflight(self) -> MemoryPlan:
        """Before any actor starts: every role must fit a node (or wait for one an autoscaler
        adds), and every node's memory must hold what the plan puts on it."""
        from actors.runtime.cluster_state import alive_nodes, can_add_nodes

        placement = place(self.cfg, alive_nodes())
        for line in check_placement(self.cfg, placement,
                                    can_add_nodes=bool(placement.waiting) and can_add_nodes()):
            self.log(f"placement: {line} (the autoscaler may add it)")
        facts = model_facts(self.cfg.policy, self.spec)
        self.cfg, note = choose_sharding(self.cfg, self.spec, placement, facts)
        if note:
            self.log(note)
        plan = estimate(self.cfg, self.spec, placement, facts)
        totals = ", ".join(f"{p.node.label}: {p.host_mb:,.0f} of {p.node.host_memory_mb:,.0f} MB"
                           for p in plan.nodes if p.components)
        self.log(f"memory plan: {totals}")
        if self.cfg.ray.check_memory:
            plan.check()
        else:
            for problem in plan.problems():
                self.log(f"warning: memory plan: {problem}")
        return plan

    @property
    def learners(self) -> list:
        """The learner ranks that train now (a rebuilt group may have fewer)."""
        return self.topology.group.active

    def _sync_initial_weights(self) -> None:
        topo = self.topology
        if self.resume:
            ckpt = locate_checkpoint(self.files.uri)
            ray.get([lr.restore.remote(ckpt) for lr in topo.learners])
            meta = read_meta(ckpt)
            self.counters.update(meta.counters)
            self.partial_counters = [k for k in RUN_COUNTERS if k not in meta.counters]
            if self.partial_counters:
                self.log(f"this checkpoint predates whole-run counts of "
                          f"{', '.join(self.partial_counters)}: they count from this leg")
            self.samplers_continued = restore_samplers(topo.workers, meta.samplers,
                                                       self.counters["episodes"])
            self.log(f"resumed at version {meta.version}: {self.samplers_continued} of "
                      f"{len(topo.workers)} env workers continue their episode sequence"
                      + ("" if self.samplers_continued == len(topo.workers) else
                         ", the others start a new one (no saved sampler state)"))
        elif self.cfg.init_from:
            ckpt = locate_checkpoint(self.cfg.init_from)
            ray.get([lr.load_weights.remote(ckpt) for lr in topo.learners])
        message: WeightsMessage = ray.get(topo.learners[0].weights_message.remote())
        ref = ray.put(message)
        ray.get([s.load_weights_now.remote(ref) for s in topo.servers])
        self._wait_for_env_workers()
        ray.get(topo.queue.set_version.remote(message.version, True, message.lineage))

    # ---- running -------------------------------------------------------------------------
    def run(self) -> dict:
        self.check_storage()
        self.files.write_text("config.yaml", yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        topo = self._topology or self.build()
        self.log(f"rlvla3 rl: mode={self.cfg.pipeline.mode} pipeline={self.choices} "
                  f"env={self.cfg.env.name} policy={self.cfg.policy.name} "
                  f"run_dir={self.files.uri}")
        self.log(learner_line(self.cfg))
        self.log(self.budget.line(self.counters))
        self._warn_staleness_bound()
        self.budget.begin(self.counters)
        self.steps = StepLog(self.run_dir, self.log)
        self.checkpoints = Checkpointer(self.learners, topo.workers, self.files.uri,
                                        self.cfg.checkpoint_every,
                                        ray.get(self.learners[0].version.remote()), self.log)
        self.checkpoints.pinned = self.evaluator.reading  # a running eval's snapshot stays
        watchdog = threading.Thread(target=self._watchdog, daemon=True, name="watchdog")
        watchdog.start()
        self.capacity.start()
        self._next_tick = time.monotonic()
        try:
            self.stop_record = self.schedule.run(self)
        finally:
            self._watchdog_stop.set()
            self.capacity.stop()
        summary = self._tick(final=True)
        assert summary is not None  # a final tick returns the summary or raises
        summary["stopped_by"] = self.stopped_by
        summary["target_reached"] = self.budget.target_reached
        self.files.write_text("summary.json", json.dumps(summary, indent=2))
        self.files.push("metrics.jsonl", "steps.jsonl", "tb")
        if line := groups_by_task_line(summary):
            self.log(line)
        self.log(f"stopped by {self.stopped_by}; summary: {join(self.files.uri, 'summary.json')}")
        return summary

    def _warn_staleness_bound(self) -> None:
        """Asynchronous runs: a longest episode accrues about slots x decisions / global_batch
        versions of lag while it runs, a GRPO group that many times the episodes a slot runs
        for it (in every round dynamic sampling draws); a bound below that discards the old
        part of long episodes and expires groups."""
        cfg = self.cfg
        if not self.schedule.concurrent:
            return
        slots = cfg.env_workers.num_workers * cfg.env_workers.slots_per_worker
        group = cfg.algo.group_size if cfg.algo.name == "grpo" else 1
        draws = 1 + (cfg.algo.redraw_rounds if cfg.algo.name == "grpo" else 0)
        rounds = group_rounds(group, cfg.env_workers.slots_per_worker) * draws
        inherent = inherent_lag(slots, self.spec.max_decisions, rounds, cfg.algo.update_epochs,
                                cfg.learner.global_batch)
        if cfg.queue.max_staleness >= inherent:
            return
        grouped, expire = "", ""
        if rounds > 1:
            grouped = f" x {rounds} episodes a slot runs for one GRPO group of {cfg.algo.group_size}"
            if draws > 1:
                grouped += f" drawn up to {draws} times (algo.redraw_rounds)"
            expire = " and GRPO groups whose first episode grows too old expire"
        epochs = f" x {cfg.algo.update_epochs} update_epochs" if cfg.algo.update_epochs > 1 else ""
        self.log(f"note: queue.max_staleness={cfg.queue.max_staleness} is below the lag a "
                  f"longest episode accrues at this scale ({slots} slots x "
                  f"{self.spec.max_decisions} decisions{grouped}{epochs} / global_batch "
                  f"{cfg.learner.global_batch} = {inherent:.1f} versions): pacing runs fewer "
                  f"slots at once, the old part of long episodes may be discarded{expire}; raise "
                  f"queue.max_staleness or learner.global_batch to avoid it")

    def _watchdog(self) -> None:
        """Print what the run waits on when nothing moved for ``watchdog_s`` (its own thread,
        so that a blocked round cannot silence it)."""
        every = self.cfg.watchdog_s
        if not every:
            return
        topo, last, since, told = self.topology, None, time.monotonic(), 0.0
        state: str | tuple[int, int]
        while not self._watchdog_stop.wait(min(every / 4, 5.0)):
            try:
                workers = ray.get([w.stats.remote() for w in topo.workers], timeout=10)
                learners = ray.get([lr.stats.remote() for lr in self.learners], timeout=10)
                queue = ray.get(topo.queue.stats.remote(), timeout=10)
            except Exception as exc:  # noqa: BLE001 - a role that cannot answer is the news
                answered, state = False, (f"a role did not answer its stats call "
                                          f"({type(exc).__name__})")
            else:
                answered, state = True, (sum(w.env_steps for w in workers), learners[0].version)
            now = time.monotonic()
            if state != last:
                last, since = state, now
                continue
            if now - since >= every and now - told >= every:
                told = now
                detail = state if not answered else waiting_on(
                    queue, workers, learners, self.cfg.learner.global_batch,
                    self.cfg.queue.capacity if self.schedule.concurrent else 1 << 30)
                self.log(f"watchdog: no env or optimizer step for {now - since:.0f}s; {detail}")

    # ---- what the schedule calls (actors.rl.schedule.Run) ---------------------------------
    def done(self) -> bool:
        """Whether the run ends now; ``stopped_by`` names the limit that ended it."""
        self.stopped_by = self.budget.stop_reason(self.monitor.env_steps)
        return self.stopped_by is not None

    def tick_if_due(self) -> None:
        if time.monotonic() >= self._next_tick:
            self._tick()
            self._next_tick = time.monotonic() + self.cfg.log_every_s

    def check_capacity(self) -> bool:
        """Raise the capacity watch's fatal error; rebuild the learner group without a rank
        that did not run for ``ray.node_wait_s`` (True when it did)."""
        if self.capacity.fatal is not None:
            raise self.capacity.fatal
        if not self.capacity.rebuild_requested.is_set():
            return False
        cause = "a learner rank has not run for ray.node_wait_s"
        self.failures.check(cause, [cause])
        self._rebuild_learners(cause)
        return True

    def learner_failed(self, exc: BaseException) -> None:
        """Rebuild the group if a rank is really gone and the rebuild budget allows; otherwise
        end the run with the error (``actors.rl.failures``). Called inside the ``except``."""
        if self.capacity.fatal is not None:
            raise self.capacity.fatal from exc
        if not self.topology.group.elastic:
            raise exc
        self.failures.check(exc, self.topology.group.lost(LOSS_GRACE_S))
        self._rebuild_learners(exc)

    def log(self, text: str) -> None:
        say(text, self.quiet)

    def _rebuild_learners(self, cause: BaseException | str) -> None:
        """A rank was lost: every rank restarts from the last checkpoint and the group forms
        again, without the ranks whose resources are gone (``LearnerGroup.rebuild``)."""
        self.log(f"learner group: a rank was lost ({str(cause).splitlines()[0][:160]}); "
                  f"every rank restarts from the last checkpoint")
        record = self.topology.group.rebuild(cause)
        self.capacity.rebuild_requested.clear()
        self.checkpoints.rolled_back(self.learners, record["version"])
        self.log(f"learner group: rebuilt with {record['ranks_after']} of "
                  f"{record['ranks_before']} ranks at v{record['version']} "
                  f"({record['restored_from']}) in {record['seconds']}s")

    def _wait_for_env_workers(self) -> None:
        """Start only once an env worker runs (on an autoscaling cluster they may wait for new
        nodes); the others join when their nodes arrive."""
        from actors.runtime.cluster_state import actor_state

        deadline = time.monotonic() + self.cfg.ray.placement_timeout_s
        told = False
        slots = self.cfg.env_workers.slots_per_worker
        while not any(actor_state(w) == "ALIVE" for w in self.topology.workers):
            self.topology.extra["status"].update.remote(
                {"env_slots_live": 0, "env_slots_waiting": slots * len(self.topology.workers)},
                "waiting for nodes")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no env worker was placed within {self.cfg.ray.placement_timeout_s:.0f}s "
                    f"(ray.placement_timeout_s): no node offers "
                    f"{next(a.resources for a in actor_specs(self.cfg) if a.role == 'env')}")
            if not told:
                self.log(f"waiting for the env workers to start ({len(self.topology.workers)};"
                          f" on an autoscaling cluster their nodes may still be launching)")
                told = True
            time.sleep(1.0)

    def request_stop(self, reason: str = "stop requested") -> None:
        """End the run at the next check, as if its budget were spent (from another thread or
        a signal handler); ``reason`` becomes ``stopped_by``."""
        self.budget.asked = reason

    # ---- a progress tick ------------------------------------------------------------------
    def _tick(self, final: bool = False) -> dict | None:
        """One progress row (None while no env worker runs yet); the final one returns the
        summary. Its steps, in order: read every role, release lost workers' admissions, make
        the row, checkpoint, publish the row, check the training target, evaluate."""
        try:
            snap = self.monitor.snapshot()
        except WaitingForActors as exc:  # nothing to report before the first env worker runs
            if final:
                raise
            self.log(f"waiting: {exc}")
            return None
        self._release_lost_workers()
        killed = (self.stop_record is not None
                  and self.stop_record["learners"] != "stopped together")  # or failed
        row, history = self._row(snap, killed)
        # before anything slow, so a run stopped by a signal with a short grace keeps its last step
        if not killed:
            self.checkpoints.save(self.counters, force=final)
        self._publish(row, history, final)
        self._check_training_target(row)
        if not final:
            self._collect_eval()
            self._maybe_start_eval(row["policy_version"])
            return row
        self._final_eval(row["policy_version"], killed)
        return self._summary(row, snap, killed)

    def _row(self, snap: Snapshot, killed: bool) -> tuple[dict, list[dict]]:
        """The progress row and the optimizer steps since the last one; the run's counters
        follow the row."""
        history = [] if killed else ray.get(self.learners[0].take_history.remote())
        elapsed = self.budget.elapsed()
        row = self.monitor.row(snap, elapsed, self.budget.base)
        row["objective"] = self.steps.add(history)
        self.counters.update({k: row[k] for k in RUN_COUNTERS},
                             wall_s=self.budget.base["wall_s"] + elapsed)
        return row, history

    def _publish(self, row: dict, history: list[dict], final: bool) -> None:
        """The row to the status actor, ``metrics.jsonl`` and TensorBoard (copied to the run's
        storage) and the console."""
        self.topology.extra["status"].update.remote(row, "finished" if final else "running")
        self.monitor.write(row, history)
        try:
            self.files.sync("metrics.jsonl", "steps.jsonl", "tb")
        except OSError as exc:  # retried at the next tick: a storage blip never stops a run
            self.log(f"warning: copying metrics to {self.files.uri} failed: {exc}")
        self.log(self.monitor.line(row, row["time_s"]))

    def _check_training_target(self, row: dict) -> None:
        """Without periodic evaluation, the target success rate is judged on training
        episodes, once ``target_window`` of them are in the row's window."""
        if not self.cfg.eval_every and row["success_window"] >= self.cfg.target_window:
            self.budget.check_target("training", row["success_rate"], row["success_window"],
                                     row["policy_version"], self.counters)

    def _final_eval(self, version: int, killed: bool) -> None:
        """The last evaluation, unless the run was asked to stop or its group was killed."""
        if self.budget.asked is not None or killed:  # stop now: no final evaluation
            self.evaluator.cancel()
        else:
            self._collect_eval(wait_s=600.0)
            self._maybe_start_eval(version, final=True)
            self._collect_eval(wait_s=600.0)

    def _accounting(self, snap: Snapshot) -> dict:
        """The final decision accounting (read again while a slot or learner still finishes
        its last call)."""
        monitor = self.monitor
        accounting = monitor.accounting(snap)
        for _ in range(5):
            if not accounting["unaccounted"]:
                break
            time.sleep(1.0)
            accounting = monitor.accounting(monitor.snapshot())
        if accounting["unaccounted"] and not any(monitor.restarts.values()):
            self.log(f"warning: {accounting['unaccounted']} decisions unaccounted: {accounting}")
        return accounting

    def _summary(self, row: dict, snap: Snapshot, killed: bool) -> dict:
        """``summary.json``: the last row and the whole run's figures."""
        topo = self.topology
        return {
            **row,
            "mode": self.cfg.pipeline.mode,
            "pipeline": self.choices.__dict__,
            "env": self.cfg.env.name,
            "policy": self.cfg.policy.name,
            "algo": self.cfg.algo.name,
            "env_slots": sum(w.slots for w in snap.workers),
            "batch_size_hist": batch_size_hist(snap.servers),
            "staleness_hist": staleness_hist(snap.learners),
            "queue_staleness_hist": snap.queue.staleness_hist,
            "episode_lengths": episode_lengths(snap),
            "accounting": self._accounting(snap),
            **split_note(self.cfg),
            "evals": self.evals,
            "nodes": topo.nodes(),
            "learner_group": learner_group(self.cfg, len(self.learners),
                                           (s.engine for s in snap.learners), topo.group.rebuilds),
            "objective": self.steps.summary(),
            "stop": self._stop_summary(killed),
            "weights_moved": None if killed or not self.cfg.init_from else round(ray.get(
                self.learners[0].distance_from.remote(self.cfg.init_from)), 7),
            "outages": [e for e in self.capacity.outages() if e["kind"] == "outage"],
            "start_waits": [e for e in self.capacity.outages() if e["kind"] == "start"],
            "memory": memory_report(self.memory_plan.role_totals(), snap),
            "wall_s": self.counters["wall_s"],
            "this_leg": {"time_s": row["time_s"],
                         **{k: row[k] - self.budget.base.get(k, 0) for k in RUN_COUNTERS}},
            **({"counts_from_this_leg": self.partial_counters} if self.partial_counters else {}),
            "checkpoints": self.checkpoints.summary(),
            "run_dir": self.files.uri,
        }

    def _stop_summary(self, killed: bool) -> dict | None:
        """How the stop went; after a killed group, the checkpoint the run ends at."""
        if self.stop_record is None or not killed:
            return self.stop_record
        try:
            last = locate_checkpoint(self.files.uri)
        except FileNotFoundError:  # CheckpointError included
            last = "none: the run ends with no checkpoint of its own"
        return {**self.stop_record, "final_checkpoint": last}

    def _release_lost_workers(self) -> None:
        """An env worker that stopped running (its node left) holds queue admissions that no
        episode will use: release them, so pacing does not wait for them."""
        down = set(self.monitor.workers.down)
        for w in down - self._down_workers:
            incarnation = self.monitor.workers.incarnation(w)
            if incarnation is not None:
                self.topology.queue.retire.remote(w, incarnation)
        self._down_workers = down

    # ---- periodic evaluation on held-out initial states ----------------------------------
    def _maybe_start_eval(self, version: int, final: bool = False) -> None:
        if self.evaluator.due(version, final):
            checkpoint = self.checkpoints.save(self.counters, force=True)
            assert checkpoint is not None  # a forced save returns its location or raises
            self.evaluator.start(version, checkpoint)

    def _collect_eval(self, wait_s: float = 0.0) -> None:
        result = self.evaluator.collect(wait_s)
        if result is not None:
            self.log(f"eval at v{result['version']}: success {result['success_rate']:.2f} "
                      f"over {result['episodes']} held-out episodes ({result['wall_s']}s)")
            self.monitor.scalar("eval/success_rate", result["success_rate"], result["version"])
            self.budget.check_target("held-out eval", result["success_rate"],
                                     result["episodes"], result["version"], self.counters)

    # ---- teardown ------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._watchdog_stop.set()
        self.evaluator.cancel()
        if self._topology is not None:
            self._topology.close()
            self._topology = None
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
            try:
                self.files.push("metrics.jsonl", "steps.jsonl", "tb")
            except OSError as exc:
                self.log(f"warning: metrics and TensorBoard events were not copied to "
                          f"{self.files.uri} ({exc}); they stay in {self.files.local}")
                return
        self.files.close()
