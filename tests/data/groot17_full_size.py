"""Write the key set, shapes and parameter count of LeRobot 0.6.1's full-size GR00T-N1.7 (run by
hand in the scratch environment of ``groot17_reference_env.sh``, never in CI)::

    /work/scratch/lerobot061/bin/python tests/data/groot17_full_size.py --out tests/data/groot_n17_keys.json

LeRobot builds ``GR00TN17`` from the model's ``config.json`` (``nvidia/GR00T-N1.7-3B``, whose
values are ``GR00T_N1_7_DEFAULTS`` in LeRobot's ``groot_n1_7.py``) and, for
``model_name = nvidia/Cosmos-Reason2-2B``, the backbone config LeRobot hard-codes
(``_cosmos_reason2_qwen3_vl_config``: Qwen3-VL-2B, vision 24 x 1024 with DeepStack after blocks
5/11/17, text 28 x 2048). Both come from LeRobot itself here, offline; ``GR00TN17`` is built on
``torch.device("meta")`` without backbone weights (no memory, no download). The output JSON holds
the GR00T config, the Qwen3-VL config, every state-dict key with its shape and the parameter
count; ``tests/policies/test_model_groot17.py`` builds rlvla3's network from the same configs
and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from importlib.metadata import version
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    import torch

    torch.distributions.Distribution.set_default_validate_args(False)
    from lerobot.policies.groot import groot_n1_7 as g

    config = dict(g.GR00T_N1_7_DEFAULTS)
    qwen = g._cosmos_reason2_qwen3_vl_config().to_dict()
    with torch.device("meta"):
        model = g.GR00TN17(g.GR00TN17Config(**config), load_backbone_weights=False)
    state = model.state_dict()
    keys = {k: list(v.shape) for k, v in state.items()}
    params = sum(math.prod(p.shape) for p in model.parameters())  # tied tensors once
    out = {"groot_config": config, "qwen3_vl_config": {
        "vision_config": {k: qwen["vision_config"][k] for k in (
            "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
            "spatial_merge_size", "temporal_patch_size", "out_hidden_size",
            "num_position_embeddings", "deepstack_visual_indexes")},
        "text_config": {k: qwen["text_config"][k] for k in (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps")} | {
            "rope_theta": qwen["text_config"].get("rope_parameters", {}).get("rope_theta")
            or qwen["text_config"].get("rope_theta"),
            "rope_scaling": {"mrope_section": (qwen["text_config"].get("rope_parameters")
                                               or qwen["text_config"].get("rope_scaling")
                                               )["mrope_section"]}}},
        "keys": keys, "parameters": params,
        "versions": {p: version(p) for p in ("lerobot", "torch", "transformers")}}
    args.out.write_text(json.dumps(out, indent=0, sort_keys=True) + "\n")
    print(json.dumps({"out": str(args.out), "keys": len(keys), "parameters": params}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
