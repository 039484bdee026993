"""Policies that implement ``rlvla3.protocols.Policy``, chosen by name in the ``policy`` section.

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
    "vla": "rlvla3.model:build_vla_policy",
    "groot": "rlvla3.model.groot:build_groot_policy",
}

OPTIONS: dict[str, str] = {
    "small": "rlvla3.policies.small:SmallPolicyConfig",
    "vla": "rlvla3.model.vla_config:VLAConfig",
    "groot": "rlvla3.model.groot.config:GrootConfig",
}
"""The dataclass each policy's ``policy.options`` build into (checked without building the
model, e.g. a ``pi05`` config on a machine without a GPU; the docs' config reference)."""


def build_policy(choice: Named, spec: EnvSpec, path: str = "policy") -> Policy:
    """Build the policy named by ``choice`` for an env with ``spec``."""
    factory = resolve(POLICIES, choice.name, f"{path}.name")
    return factory(spec, choice.options, f"{path}.options")
