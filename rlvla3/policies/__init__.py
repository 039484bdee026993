"""Policies that implement ``rlvla3.protocols.Policy``, chosen by name in the ``policy`` section.

A policy is a config, a network and a processor, in one place each:
    small       a small CNN actor-critic (one module: config, network, no processor)
    vla/        the packed pi0.5-style VLA: ``config``, ``network``, ``processor`` (with
                ``tokenizer`` and ``normalize``), ``policy``, ``inference`` (how ``act`` runs),
                and LeRobot/openpi checkpoints in (``lerobot``, ``loader``)
    groot/      GR00T-N1.5: ``config``, the network's parts, ``processor``, ``policy``,
                checkpoints in and out (``loader``, ``export``)
    export      ``rlvla3 export``: a checkpoint as a LeRobot policy directory, per policy

A factory has the signature ``factory(spec: EnvSpec, options: Mapping, path: str) -> Policy``:
it validates ``options`` into its own config dataclass (errors name ``path``.field) and builds
the model for the env's shapes.
"""

from __future__ import annotations

from rlvla3.config import Named
from rlvla3.protocols import Policy
from rlvla3.registry import resolve
from rlvla3.types import EnvSpec

POLICIES: dict[str, str] = {
    "small": "rlvla3.policies.small:build_small_policy",
    "vla": "rlvla3.policies.vla:build_vla_policy",
    "groot": "rlvla3.policies.groot:build_groot_policy",
}

OPTIONS: dict[str, str] = {
    "small": "rlvla3.policies.small:SmallPolicyConfig",
    "vla": "rlvla3.policies.vla.config:VLAConfig",
    "groot": "rlvla3.policies.groot.config:GrootConfig",
}
"""The dataclass each policy's ``policy.options`` build into (checked without building the
model, e.g. a ``pi05`` config on a machine without a GPU; the docs' config reference)."""


def build_policy(choice: Named, spec: EnvSpec, path: str = "policy") -> Policy:
    """Build the policy named by ``choice`` for an env with ``spec``."""
    factory = resolve(POLICIES, choice.name, f"{path}.name")
    return factory(spec, choice.options, f"{path}.options")
