"""Presets of ``rlvla3 sft``: one YAML file per recipe, an ``SFTConfig`` mapping (datasets
usually come from ``--dataset``)."""
