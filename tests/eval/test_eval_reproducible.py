"""An evaluation episode is a function of (policy, task, initial state, seeds, settings) alone.

- Random actions are drawn per episode: which worker runs an episode, and what it ran before,
  change nothing (they used to come from one generator per worker, consumed in order).
- Pinned numerics (``rlvla3.numerics``) make the policy's actions bit-identical whatever
  instruction sets MKL and oneDNN are allowed (what differs between CPU models), while native
  arithmetic differs in the last bits between those settings: the cause of episodes that
  flipped between machines.
- Pinned numerics also fix NumPy's OpenBLAS kernels, which the simulator's controller computes
  its torques with and which OpenBLAS otherwise picks by the host CPU: workers of hosts that
  would pick other kernels (emulated with ``OPENBLAS_CORETYPE``) run the same ones and, on
  real LIBERO (``libero``), step the robot to the same state, bit for bit.
- ``eval --recheck`` draws, re-runs and compares episodes.
- On real LIBERO (``libero``, ``slow``): the same episodes alone, inside a larger run, in
  another order, with another worker count and after a resume give identical outcomes, step
  counts and action digests, and a re-check of a finished evaluation matches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from actors.eval.options import EvalOptions
from actors.eval.recheck import (
    _acting,
    compare_rows,
    recheck_line,
    recheck_status,
    rerun_args,
    sample_episodes,
    stored_rows,
)
from actors.eval.worker import ActionSource, EvalWorker
from rlvla3.config import ConfigError, Named
from rlvla3.numerics import PINNED_ENV, NumericsError, env_vars, host

ROOT = Path(__file__).resolve().parents[2]
SFT = ROOT / "results" / "libero_spatial10" / "sft10d"
ENV = Named("reach", {"image_size": 16})


def test_random_episodes_do_not_depend_on_the_worker_or_its_history():
    source = ActionSource("random", seed=3)
    first, second = EvalWorker(ENV, source, seed=0), EvalWorker(ENV, source, seed=7)
    alone = first.run_episode(0, 3)
    second.run_episode(1, 0)  # another episode first, on another worker seed
    after = second.run_episode(0, 3)
    assert len(alone.digest) == 16 and alone.digest == after.digest
    assert (alone.steps, alone.success) == (after.steps, after.success)
    other = EvalWorker(ENV, ActionSource("random", seed=4), seed=0).run_episode(0, 3)
    assert other.digest != alone.digest  # the digest does see another trajectory
    assert first.run_episode(0, 4).digest != alone.digest


def test_numerics_modes_and_the_refusal_when_a_process_did_not_start_pinned():
    from rlvla3.numerics import HOST_BLAS, PINNED_BLAS

    assert env_vars("pinned") == PINNED_ENV | {"OPENBLAS_CORETYPE": PINNED_BLAS}
    assert env_vars("pinned", HOST_BLAS) == PINNED_ENV and env_vars("native") == {}
    assert PINNED_ENV["ATEN_CPU_CAPABILITY"] == "default"
    with pytest.raises(ValueError, match="unknown numerics"):
        env_vars("fast")
    # This test process did not start with the pinned environment.
    probe = "from rlvla3.numerics import apply; apply('pinned')"
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0 and NumericsError.__name__ in done.stderr
    assert "ATEN_CPU_CAPABILITY=default" in done.stderr
    assert host()["arch"]


ACT = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from rlvla3 import numerics
    from rlvla3.checkpoint.files import load_policy
    from rlvla3.types import ObsBatch, Observation

    info = numerics.apply(sys.argv[1])
    policy, meta = load_policy(sys.argv[2])
    policy.eval()
    rng = np.random.default_rng(0)
    h, w = meta.spec.image_size
    obs = Observation(
        images={c: rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for c in meta.spec.cameras},
        state=rng.normal(size=meta.spec.state_dim).astype(np.float32),
        instruction="pick up the black bowl next to the plate and place it on the plate")
    actions = policy.act(ObsBatch.stack([obs]), deterministic=True).actions[0]
    print(json.dumps({"digest": hashlib.sha256(np.asarray(actions, np.float32).tobytes())
                      .hexdigest(), "capability": info["torch_cpu_capability"]}))
""")

NARROW = {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""What an AVX2 machine would give MKL and oneDNN, on this one."""


def _act(mode: str, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV and k not in NARROW}
    env |= {**env_vars(mode), **extra, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", ACT, mode, str(SFT)],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host()["isa"] not in ("avx512f", "avx2"), reason="needs an AVX2 CPU")
def test_pinned_actions_do_not_depend_on_the_instruction_set_native_ones_do():
    wide, narrow = _act("pinned", {}), _act("pinned", NARROW)
    assert wide["capability"] == narrow["capability"] == "DEFAULT"
    assert wide["digest"] == narrow["digest"]
    native = _act("native", {})
    assert native["digest"] != wide["digest"]  # another summation order, another last bit
    if host()["isa"] == "avx512f":  # an AVX2 machine's native arithmetic, emulated here
        native_avx2 = _act("native", {**NARROW, "ATEN_CPU_CAPABILITY": "avx2"})
        assert native_avx2["capability"] == "AVX2"
        assert native_avx2["digest"] != native["digest"]


CONTROLLER = textwrap.dedent("""
    import hashlib, json
    import numpy as np

    # the operational-space controller's linear algebra (robosuite), on a random arm
    rng = np.random.default_rng(0)
    m = rng.normal(size=(7, 7))
    mass_inv = np.linalg.inv(m @ m.T + 7 * np.eye(7))
    jac = rng.normal(size=(6, 7))
    torque = jac.T @ np.linalg.pinv(jac @ mass_inv @ jac.T) @ rng.normal(size=6)
    print(json.dumps({"digest": hashlib.sha256(torque.tobytes()).hexdigest()}))
""")
CORE = "from rlvla3.numerics import numpy_blas; import json; print(json.dumps(numpy_blas()))"

OTHER_HOSTS = ("Nehalem", "Sandybridge")
"""OpenBLAS cores older x86-64 hosts pick by themselves (any AVX2 CPU runs them): the hosts a
test emulates on this one with ``OPENBLAS_CORETYPE``."""


def _worker_env(host_core: str | None, numerics: dict[str, str]) -> dict[str, str]:
    """The environment a worker process starts with on a host whose OpenBLAS picks
    ``host_core`` (None: this host's own choice): the host's, then ``runtime_env``'s."""
    env = {k: v for k, v in os.environ.items() if k not in PINNED_ENV and
           k != "OPENBLAS_CORETYPE"}
    return env | ({"OPENBLAS_CORETYPE": host_core} if host_core else {}) | numerics | {
        "PYTHONPATH": str(ROOT)}


def _run(script: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answer(proc: subprocess.Popen, timeout: float = 300) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(host()["isa"] not in ("avx512f", "avx2"), reason="needs an AVX2 CPU")
def test_pinned_workers_run_the_same_blas_kernels_whatever_the_host_picks():
    hosts = (None, *OTHER_HOSTS)
    pinned = [_answer(p) for p in [_run(CONTROLLER, _worker_env(h, env_vars("pinned")))
                                   for h in hosts]]
    assert len({p["digest"] for p in pinned}) == 1
    # the emulated hosts do differ: left to the host (native numerics), each runs its own
    # kernels and the torques differ in the last bits
    native = [_answer(_run(CONTROLLER, _worker_env(h, env_vars("native")))) for h in OTHER_HOSTS]
    assert len({p["digest"] for p in native}) == 2

    from rlvla3.numerics import HOST_BLAS, PINNED_BLAS, check_blas

    cores = [_answer(_run(CORE, _worker_env(h, env_vars(mode)))) for mode in ("pinned", "native")
             for h in OTHER_HOSTS]
    assert cores == [PINNED_BLAS, PINNED_BLAS, *OTHER_HOSTS]
    # pinned as evaluations were before the kernels were pinned: the host's kernels
    legacy = _answer(_run(CONTROLLER, _worker_env(OTHER_HOSTS[0], env_vars("pinned", HOST_BLAS))))
    assert legacy == native[0]
    # a worker whose OpenBLAS does not run the pinned kernels refuses to run pinned
    probe = "from rlvla3.numerics import apply; apply('pinned')"
    refused = _run(probe, _worker_env(None, env_vars("pinned") | {"OPENBLAS_CORETYPE": "Nehalem"}))
    _, err = refused.communicate(timeout=300)
    assert refused.returncode != 0 and "NumericsError" in err and PINNED_BLAS in err
    check_blas(PINNED_BLAS)  # this machine runs them
    with pytest.raises(ConfigError, match="--blas"):
        check_blas("NoSuchCore")


SIMULATOR = textwrap.dedent("""
    import hashlib, json
    import numpy as np
    from envs.libero.env import LiberoConfig, LiberoEnv

    env = LiberoEnv(LiberoConfig(task_ids=(0,), image_size=(32, 32), placements="bundled",
                                 process=False))
    env.reset(0, 20)  # the scene settles for 10 steps under the arm's controller
    env.step(np.tile([0.5, 0.0, -0.3, 0.0, 0.0, 0.2, -1.0], (5, 1)))
    data = env.raw.sim.data
    state = np.concatenate([data.qpos, data.qvel])
    print(json.dumps({"state": hashlib.sha256(state.tobytes()).hexdigest()}))
    env.close()
""")


@pytest.mark.libero
@pytest.mark.skipif(find_spec("libero") is None, reason="LIBERO not installed")
@pytest.mark.skipif(host()["isa"] not in ("avx512f", "avx2"), reason="needs an AVX2 CPU")
def test_a_pinned_simulator_steps_the_same_whatever_blas_kernels_the_host_picks():
    """The simulator process of a pinned eval worker (it inherits the worker's environment) on
    two hosts whose OpenBLAS picks other kernels: the same robot and objects, bit for bit,
    after a reset and one chunk. Left to the host, the kernels move the state (on the real
    episodes the observations part a few decisions later)."""
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    runs = [_run(SIMULATOR, _worker_env(h, env_vars("pinned"))) for h in OTHER_HOSTS]
    runs.append(_run(SIMULATOR, _worker_env(OTHER_HOSTS[0], env_vars("native"))))
    first, second, left_to_host = (_answer(r, timeout=600) for r in runs)
    assert first == second
    assert left_to_host != first


def _results(rows: dict[tuple[int, int], dict]) -> dict:
    tasks: dict[str, dict] = {}
    for (task, state), row in rows.items():
        tasks.setdefault(str(task), {"by_init_state": []})["by_init_state"].append(
            {"init_state": state, **row}
        )
    return {"tasks": tasks}


def test_recheck_samples_reproducibly_and_counts_each_kind_of_difference():
    episodes = [(t, k) for t in range(10) for k in range(50)]
    first = sample_episodes(episodes, 20, seed=0)
    assert first == sample_episodes(list(reversed(episodes)), 20, seed=0)  # order-free
    assert len(set(first)) == 20 and first != sample_episodes(episodes, 20, seed=1)
    assert sample_episodes(episodes[:3], 20, seed=0) == episodes[:3]
    stored = stored_rows(
        _results(
            {
                (2, 7): {"success": True, "steps": 97, "digest": "a" * 16},
                (2, 31): {"success": False, "steps": 220, "digest": "b" * 16},
                (8, 7): {"success": True, "steps": 116},
                (8, 31): {"success": False, "steps": 220, "digest": "c" * 16},
            }
        )
    )
    now = {
        (2, 7): {"success": True, "steps": 93, "digest": "d" * 16},
        (2, 31): {"success": True, "steps": 98, "digest": "e" * 16},
        (8, 7): {"success": True, "steps": 116, "digest": "f" * 16},
        (8, 31): {"success": False, "steps": 220, "digest": "c" * 16},
    }
    report = compare_rows(stored, now)
    assert report["checked"] == 4 and report["matching"] == 2
    assert report["outcome_flips"] == 1 and report["step_differences"] == 2
    assert report["digest_checked"] == 3 and report["digest_differences"] == 2
    assert [(m["task"], m["init_state"]) for m in report["mismatches"]] == [(2, 7), (2, 31)]
    assert report["faults"] == [] and recheck_status(report) == 1
    # an episode whose worker was lost is not a difference: listed, then run again
    lost = {**now, (2, 7): {"success": False, "steps": 0, "fault": "eval worker lost 3 times"},
            (2, 31): {"success": False, "steps": 220, "digest": "b" * 16}}
    report = compare_rows(stored, lost)
    assert report["checked"] == 3 and report["matching"] == 3 and report["outcome_flips"] == 0
    assert report["faults"] == [{"task": 2, "init_state": 7, "fault": "eval worker lost 3 times"}]
    assert recheck_status(report) == 3
    line = recheck_line({**report, "recheck": "DIR", "fingerprint_differences": []})
    assert "3 identical" in line and "1 not re-run (eval worker lost 3 times)" in line
    assert _acting("sampled noise_level=0.1 init_noise=0") == {
        "sampled": True,
        "noise_level": 0.1,
        "init_noise": 0.0,
    }
    assert _acting("deterministic")["sampled"] is False


def test_recheck_refuses_a_checkpoint_with_other_weights(tmp_path):
    from commands.eval import parse_args
    from rlvla3.fingerprint import checkpoint_identity

    rl18 = str(ROOT / "results/libero_spatial10/rl18")
    identity = {  # as evaluations wrote it before numerics were pinned
        "suite": "libero_spatial",
        "placements": "bundled",
        "placement_seed": 0,
        "policy": checkpoint_identity(rl18)["sha256"],
        "cameras": ["agentview", "wrist"],
        "image_size": [64, 64],
        "chunk_len": 5,
        "max_steps": 220,
        "fast_render": True,
        "acting": "deterministic",
        "seed": None,
        "language": "own",
    }
    fingerprint = {"checkpoint": {"path": "runs/rl18/checkpoints/step-00000846"}}
    (tmp_path / "eval.json").write_text(
        json.dumps({"identity": identity, "fingerprint": fingerprint})
    )
    args = parse_args(["--recheck", str(tmp_path), "--checkpoint", str(SFT)])
    with pytest.raises(ConfigError, match="holds weights"):
        rerun_args(args, tmp_path, [(2, 7)])
    args = parse_args(["--recheck", str(tmp_path)])  # the recorded path is not here
    with pytest.raises(ConfigError, match="give the checkpoint with --checkpoint"):
        rerun_args(args, tmp_path, [(2, 7)])
    rerun = rerun_args(
        parse_args(["--recheck", str(tmp_path), "--checkpoint", rl18]), tmp_path, [(2, 7)]
    )
    assert rerun.checkpoint == rl18 and rerun.episodes == ((2, 7),)
    assert rerun.numerics == "native"  # it was evaluated before numerics were pinned
    assert rerun.blas == "host"  # and before NumPy's kernels were
    assert not rerun.sampled and rerun.max_steps == 220 and rerun.image_size == (64, 64)
    assert isinstance(rerun, EvalOptions) and rerun.task_ids == () and rerun.compare == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        rerun.seed = 1  # type: ignore[misc]  # an evaluation's options do not change under it


# ---- real LIBERO ---------------------------------------------------------------------------
def _eval(out: Path, *argv: str) -> dict[tuple[int, int], tuple]:
    from commands.eval import main

    assert (
        main(
            [
                "--suite",
                "libero_spatial",
                "--checkpoint",
                str(SFT),
                "--max-steps",
                "40",
                "--videos",
                "0",
                "--output-dir",
                str(out),
                *argv,
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["fingerprint"]["numerics"]["mode"] == "pinned"
    return {
        key: (row["success"], row["steps"], row["digest"])
        for key, row in stored_rows(results).items()
    }


@pytest.mark.libero
@pytest.mark.slow
@pytest.mark.skipif(find_spec("libero") is None, reason="LIBERO not installed")
def test_an_episode_is_the_same_alone_in_a_larger_run_reordered_and_after_a_resume(
    ray_cluster, tmp_path, capsys
):
    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    from commands.eval import main

    alone = _eval(tmp_path / "alone", "--episodes", "2:7", "8:31", "4:48", "--workers", "1")
    # One worker, so task 4's simulator runs two of its episodes first (LIBERO grows a sampler
    # list per reset), and every episode shares the run with five others.
    larger = _eval(tmp_path / "larger", "--episodes", "4:47", "4:3", "4:48", "8:5", "8:31", "2:7",
                   "--workers", "1")
    # A resumed run that computes the rest in another order, on three workers.
    _eval(tmp_path / "resumed", "--episodes", "8:5", "--workers", "1")
    resumed = _eval(tmp_path / "resumed", "--episodes", "8:31", "2:7", "8:5", "4:48",
                    "--workers", "3")
    for key in [(2, 7), (8, 31), (4, 48)]:
        assert alone[key] == larger[key] == resumed[key], key
    assert larger[(8, 5)] == resumed[(8, 5)]
    assert len({larger[k][2] for k in larger}) == len(larger)  # digests tell episodes apart
    capsys.readouterr()
    # A re-check of the larger run, on two of its episodes, finds them identical.
    assert main(["--recheck", str(tmp_path / "larger"), "--sample", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["checked"] == report["matching"] == report["digest_checked"] == 2
    assert report["fingerprint_differences"] == []


def test_a_lost_worker_is_replaced_and_its_episode_runs_again(ray_cluster):
    from actors.eval.rounds import EvalRound, make_eval_workers

    jobs = [(t, k) for k in range(3) for t in range(2)]
    clean = {(o.task_id, o.init_state_id): o.digest
             for o in EvalRound(make_eval_workers(ENV, 1, num_cpus=0.5), jobs).wait()}
    workers = make_eval_workers(ENV, 2, num_cpus=0.5)
    round_ = EvalRound(workers, jobs, retries=2,
                       spawn=lambda: make_eval_workers(ENV, 1, num_cpus=0.5)[0])
    ray_cluster.kill(workers[0])  # under its first episode
    outcomes = round_.wait()
    assert round_.replaced == 1 and workers[0] not in round_.workers
    assert not any(o.fault for o in outcomes) and len(outcomes) == len(jobs)
    assert {(o.task_id, o.init_state_id): o.digest for o in outcomes} == clean
    # Without a spawner the last worker's loss ends what is left as faults, not a crash.
    alone = make_eval_workers(ENV, 1, num_cpus=0.5)
    round_ = EvalRound(alone, jobs[:2], retries=0)
    ray_cluster.kill(alone[0])
    faults = round_.wait()
    assert len(faults) == 2 and all(o.fault for o in faults)


def test_a_worker_that_cannot_load_its_checkpoint_stops_the_round_before_any_episode(
        ray_cluster, tmp_path):
    """A checkpoint whose weights were overwritten: every worker's constructor fails the same
    way, so the round stops with that error; no episode is recorded as a fault (or a failure)
    and no replacement is spawned to fail again."""
    from actors.eval.rounds import EvalRound, make_eval_workers
    from envs import env_spec
    from rlvla3.checkpoint.files import CheckpointMeta, save_run_checkpoint
    from rlvla3.checkpoint.trust import locate_checkpoint
    from rlvla3.policies import build_policy

    small = Named("small", {"channels": 4, "hidden": 16})
    spec = env_spec(ENV)
    save_run_checkpoint(tmp_path / "run", build_policy(small, spec),
                        CheckpointMeta(small, spec, 1))
    (Path(locate_checkpoint(tmp_path / "run")) / "policy.safetensors").write_bytes(b"x" * 5)
    source = ActionSource("checkpoint", str(tmp_path / "run"))
    spawned = []

    def spawn():
        spawned.append(make_eval_workers(ENV, 1, num_cpus=0.5, source=source)[0])
        return spawned[-1]

    round_ = EvalRound(make_eval_workers(ENV, 1, num_cpus=0.5, source=source), [(0, 0), (0, 1)],
                       spawn=spawn)
    with pytest.raises(RuntimeError, match=r"could not start: .*CheckpointError: .*"
                                           r"policy\.safetensors holds 5 bytes") as stopped:
        round_.wait()
    assert type(stopped.value).__name__ == "EvalSetupError"
    assert round_.outcomes == [] and spawned == []


IDENT = {"suite": "libero_spatial", "language": "own", "numerics": "pinned"}


def test_a_resumed_evaluation_reruns_episodes_a_fault_ended(tmp_path):
    from actors.eval.output_dir import EvalOutput

    output = EvalOutput(tmp_path, IDENT)
    output.add({"task": 0, "init_state": 1, "success": True, "steps": 90}, 1.0)
    output.add({"task": 0, "init_state": 2, "success": False, "steps": 0,
                "fault": "eval worker lost 3 times"}, 2.0)
    output.close()
    resumed = EvalOutput(tmp_path, IDENT)
    assert resumed.done() == {(0, 1)}  # the faulted episode runs again
    resumed.add({"task": 0, "init_state": 2, "success": True, "steps": 120}, 1.0)
    assert sorted((r["init_state"], r["success"]) for r in resumed.rows) == [(1, True), (2, True)]
    resumed.close()
    assert [r["init_state"] for r in EvalOutput(tmp_path, IDENT).rows] \
        == [1, 2]  # the rerun's line replaces the fault's


def test_an_output_written_before_the_scene_rule_is_not_resumed(tmp_path):
    """Its task-4 episodes were drawn after as many extra draws as the simulator had resets;
    continuing it with today's draw would mix two scene rules in one result."""
    from actors.eval.evaluate import _identity, env_options, eval_tasks
    from actors.eval.output_dir import IDENTITY_KEYS, EvalOutput
    from commands.eval import parse_args
    from envs.libero.scenes import SCENE_RULE

    assert "scenes" in IDENTITY_KEYS
    now = {**IDENT, "scenes": SCENE_RULE}
    EvalOutput(tmp_path / "before", IDENT).close()  # no ``scenes``: written before the rule
    with pytest.raises(SystemExit, match=f"scenes: None != '{SCENE_RULE}'"):
        EvalOutput(tmp_path / "before", now)
    EvalOutput(tmp_path / "now", now).close()
    EvalOutput(tmp_path / "now", now).close()  # the same rule resumes
    args = parse_args(["--suite", "libero_spatial", "--policy", "random"])
    assert _identity(args, env_options(args, eval_tasks(args)))["scenes"] == SCENE_RULE


@pytest.mark.libero
@pytest.mark.slow
@pytest.mark.skipif(find_spec("libero") is None, reason="LIBERO not installed")
def test_an_evaluation_of_a_run_that_goes_on_saving_loads_the_checkpoint_it_hashed(
        ray_cluster, tmp_path, monkeypatch):
    """``--checkpoint RUN_DIR`` while the run is still training: the run saves a newer
    checkpoint (here one that cannot load) after the evaluation hashed ``latest`` and before
    its workers start; every worker loads the checkpoint the fingerprint names."""
    import shutil

    from envs.libero.simulator import libero_available

    why = libero_available()
    if why:
        pytest.skip(why)
    from actors.eval import evaluate
    from commands.eval import main as eval_main
    from rlvla3.checkpoint.trust import locate_checkpoint

    run = tmp_path / "run"
    shutil.copytree(SFT, run)
    first = locate_checkpoint(run)
    newer = run / "checkpoints" / "step-00009999"
    shutil.copytree(first, newer)
    (newer / "policy.safetensors").write_bytes(b"not the weights")  # not what meta.json lists
    opened = evaluate.EvalOutput

    def training_goes_on(*a, **k):  # the identity is taken; the run saves a newer checkpoint
        (run / "checkpoints" / "latest").write_text("step-00009999\n")
        return opened(*a, **k)

    monkeypatch.setattr(evaluate, "EvalOutput", training_goes_on)
    out = tmp_path / "eval"
    assert eval_main(["--suite", "libero_spatial", "--checkpoint", str(run), "--episodes",
                      "2:7", "--max-steps", "10", "--videos", "0", "--workers", "1",
                      "--output-dir", str(out), "--json"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["faults"] == 0 and results["episodes"] == 1
    assert results["checkpoint"] == first == results["fingerprint"]["checkpoint"]["path"]
