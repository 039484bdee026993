"""The building blocks the policies' networks share: packed variable-length attention behind
one function (``attention``), the layers (``layers``: RMSNorm, rotary embeddings, block-scaled
linears), FP8 (``fp8``: formats and backends; ``fp8_kernels``, ``fp8_triton``: the kernel
sets; ``fp8_select``: the choice by name or by measurement, timed with ``timing``) and the
flow-matching math of the action experts (``flow``: targets, denoising chains, per-step
log-probabilities for RL).

The networks themselves are the policies' (``rlvla3.policies.vla``: pi0.5-style,
``rlvla3.policies.groot``: GR00T-N1.5); what measures them is ``measure.gpu`` (the GPU check,
the packing benchmark) and ``measure.parity`` (against LeRobot's reference implementations).
"""
