"""Write the key set, shapes and parameter count of LeRobot 0.5.1's full-size GR00T-N1.5 (run by
hand in the scratch environment of ``groot_reference_env.sh``, never in CI)::

    /work/scratch/groot-ref/bin/python tests/data/groot_full_size.py --out /tmp/groot_n15_keys.json

LeRobot builds ``GR00TN15`` from two config files it fetches from the Hub: the model's
``config.json`` (``nvidia/GR00T-N1.5-3B``: ``backbone_cfg``, ``action_head_cfg``) and the Eagle
``config.json`` of its processor assets (``lerobot/eagle2hg-processor-groot-n1p5``). Offline,
their published values are written here (``GROOT_N15`` and ``EAGLE_N15``, as the public
``nvidia/GR00T-N1.5-3B`` config and Isaac-GR00T's ``eagle2_hg_model/config.json`` state them:
SigLIP 1152 x 27 at 224 px without pixel shuffle and a one-layer connector, Qwen3-1.7B cut at
layer 12, the action head of 16 DiT layers of 32 x 48), the Eagle one into ``HF_LEROBOT_HOME``
where LeRobot reads it, and ``GR00TN15`` is built on ``torch.device("meta")`` (no memory, no
weights). The output JSON holds both configs, every state-dict key with its shape, and the
parameter count; ``tests/policies/test_model_groot.py`` builds rlvla3's network from the same two
configs and compares.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import groot_reference as ref  # noqa: E402

EAGLE_N15 = {
    "architectures": ["Eagle25VLForConditionalGeneration"],
    "auto_map": ref.eagle_config(0, 0)["auto_map"],
    "model_type": "eagle_2_5_vl", "downsample_ratio": 0.5, "dynamic_image_size": True,
    "force_image_size": 224, "image_token_index": 151669, "max_dynamic_tiles": 12,
    "min_dynamic_tiles": 1, "mlp_checkpoint": False, "mlp_connector_layers": 1,
    "select_layer": -1, "template": "qwen3-chat", "use_pixel_shuffle": False,
    "use_thumbnail": True, "_attn_implementation": "sdpa",
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152,
                      "intermediate_size": 4304, "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14, "image_size": 224,
                      "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
                      "num_channels": 3},
    "text_config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                    "vocab_size": 151680, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 40960, "tie_word_embeddings": True,
                    "hidden_act": "silu", "attention_bias": False,
                    "_attn_implementation": "sdpa"},
}

GROOT_N15 = {
    "model_type": "gr00t_n1_5", "architectures": ["GR00TN15"], "action_horizon": 16,
    "action_dim": 32, "compute_dtype": "float32", "hidden_size": 2048,
    "backbone_cfg": {"tune_llm": False, "tune_visual": True, "select_layer": 12,
                     "reproject_vision": False, "use_flash_attention": False,
                     "load_bf16": False, "project_to_dim": None},
    "action_head_cfg": {
        "action_dim": 32, "action_horizon": 16, "add_pos_embed": True,
        "backbone_embedding_dim": 2048, "hidden_size": 1024, "input_embedding_dim": 1536,
        "max_action_dim": 32, "max_state_dim": 64, "max_num_embodiments": 32,
        "model_dtype": "float32", "noise_beta_alpha": 1.5, "noise_beta_beta": 1.0,
        "noise_s": 0.999, "num_inference_timesteps": 4, "num_target_vision_tokens": 32,
        "num_timestep_buckets": 1000, "max_seq_len": 1024, "tune_diffusion_model": True,
        "tune_projector": True, "use_vlln": True,
        "vl_self_attention_cfg": {"attention_head_dim": 64, "num_attention_heads": 32,
                                  "num_layers": 4, "dropout": 0.2, "final_dropout": True,
                                  "positional_embeddings": None},
        "diffusion_model_cfg": {"attention_head_dim": 48, "num_attention_heads": 32,
                                "num_layers": 16, "output_dim": 1024, "dropout": 0.2,
                                "final_dropout": True, "interleave_self_attention": True,
                                "norm_type": "ada_norm", "cross_attention_dim": 2048,
                                "positional_embeddings": None},
    },
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="groot_home_"))
    cache = ref.setup_home(home)
    (cache / "config.json").write_text(json.dumps(EAGLE_N15, indent=1))
    import torch
    from lerobot.policies.groot.groot_n1 import GR00TN15, GR00TN15Config

    with torch.device("meta"):
        model = GR00TN15(GR00TN15Config(**GROOT_N15), local_model_path=str(home / "none"))
    keys = {k: list(v.shape) for k, v in model.state_dict().items()}
    params = sum(math.prod(p.shape) for p in model.parameters())
    out = {"source": "LeRobot 0.5.1 GR00TN15 on the meta device (tests/data/groot_full_size.py)",
           "versions": {p: version(p) for p in ("lerobot", "torch", "transformers")},
           "groot_config": GROOT_N15, "eagle_config": EAGLE_N15, "parameters": params,
           "keys": keys}
    args.out.write_text(json.dumps(out, indent=0, sort_keys=False) + "\n")
    shutil.rmtree(home, ignore_errors=True)
    print(json.dumps({"out": str(args.out), "keys": len(keys), "parameters": params}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
