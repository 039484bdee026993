"""What an RL run checks and starts before any actor: the config against the env and policy
registries (ids in range, the training split, ``init_from`` and ``algo.sft_datasets`` fit this env
and policy), then the Ray it runs on (the configured cluster, or a local one sized for the roles).
Every refusal here is one ``ConfigError`` line before Ray starts.

Example::

    spec = check_components(cfg)
    cpus = ensure_ray(cfg)
"""

from __future__ import annotations

import os

import ray

from actors.runtime.bootstrap import NAMESPACE, init_ray
from envs import check_training_split, dilate_env, env_spec
from rlvla3.checkpoint.files import check_init_from
from rlvla3.config import ConfigError, require
from rlvla3.machine import local_ray_cpus, usable_cpus
from rlvla3.plan.cluster import actor_specs
from rlvla3.policies import build_policy
from rlvla3.protocols import as_module
from rlvla3.run_config import RunConfig, check_resources
from rlvla3.types import EnvSpec


def check_components(cfg: RunConfig) -> EnvSpec:
    """Validate env and policy options through their registries; return the env spec."""
    from actors.eval.rounds import protocol_env

    spec = env_spec(dilate_env(cfg.env, cfg.time_dilation))  # a dilated env must simulate latency
    eval_states = env_spec(protocol_env(cfg.env)).num_init_states  # LIBERO: the 50 bundled
    for ids, name, bound in ((cfg.env_workers.task_ids, "env_workers.task_ids", spec.num_tasks),
                             (cfg.env_workers.init_state_ids, "env_workers.init_state_ids",
                              spec.num_init_states),
                             (cfg.eval_init_state_ids, "eval_init_state_ids", eval_states)):
        bad = [i for i in ids if not 0 <= i < bound]
        require(not bad, name, f"ids {bad} out of range 0..{bound - 1}")
    check_training_split(cfg.env, cfg.env_workers.init_state_ids)  # never on eval states
    policy = build_policy(cfg.policy, spec)
    if cfg.init_from:
        check_init_from(cfg.init_from, cfg.policy, spec, as_module(policy))
    if cfg.algo.sft_coef > 0:
        check_sft_datasets(cfg.algo.sft_datasets, spec, policy)
    return spec


def check_sft_datasets(uris: tuple[str, ...], spec: EnvSpec, policy: object) -> None:
    """``algo.sft_coef``'s demonstrations open, and fit this env and policy (one clear line
    before Ray starts, not a learner that dies loading them)."""
    from datalake.demos import check_demos
    from datalake.format import DatasetError, open_dataset

    require(callable(getattr(policy, "sft_loss", None)), "algo.sft_coef",
            f"the {type(policy).__name__} policy has no sft_loss to train on demonstrations")
    for uri in uris:
        try:
            check_demos(open_dataset(uri), spec)
        except (DatasetError, OSError) as exc:
            raise ConfigError("algo.sft_datasets", str(exc)) from None


def ensure_ray(cfg: RunConfig, log_to_driver: bool = True) -> float:
    """Connect to the configured cluster or start a local one; return its CPU count.
    ``log_to_driver=False`` keeps the actors' output off this process's stdout (JSON output).

    A local Ray gets at least as many logical CPUs as the roles ask for (env workers mostly
    wait on simulators), but the learners are checked against the cores this process may use
    (``rlvla3.machine.usable_cpus``)."""
    physical = float(usable_cpus())
    if not ray.is_initialized():
        if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
            check_resources(cfg, physical, learners_only=True)
        need = (cfg.learner.num_learners * cfg.learner.num_cpus
                + cfg.rollout.num_servers * cfg.rollout.num_cpus
                + cfg.env_workers.num_workers * cfg.env_workers.num_cpus)
        cpus = cfg.ray.num_cpus or local_ray_cpus(need)
        # local-only arguments are dropped when joining a cluster; an error there is one line
        init_ray(cfg.ray.address, num_cpus=cpus, resources=local_resources(cfg),
                 namespace=NAMESPACE, log_to_driver=log_to_driver, configure_logging=False)
    return float(ray.cluster_resources().get("CPU", physical))


def local_resources(cfg: RunConfig) -> dict[str, float]:
    """The custom resources a local Ray offers: what the roles ask for (``{sim: 2}`` in a config
    written for a cluster), so the same config runs on one machine."""
    out: dict[str, float] = {}
    for actor in actor_specs(cfg):
        for k, v in actor.resources.items():
            if k not in ("CPU", "GPU"):
                out[k] = out.get(k, 0.0) + v
    return out
