"""What a LeRobot groot export needs beside it (``rlvla3.policies.groot.export``): the base
model LeRobot builds the policy on is the export's own ``base/`` (or N1.5's Hub id), never a
path a source checkpoint recorded; no file LeRobot reads names a path outside the export; the
Eagle assets LeRobot reads from ``HF_LEROBOT_HOME`` are all there. LeRobot loading such an
export as a user does: ``tests/data/groot_reference.py --export`` (run by hand)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from measure.parity import groot as parity
from rlvla3.policies.export import ExportError, export_checkpoint
from rlvla3.policies.groot.config import PRESETS, GrootConfig, shapes_from_configs
from rlvla3.policies.groot.loader import read_checkpoint

FIXTURE = parity.fixture_path()
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_export_builds_on_its_own_base_and_names_no_path_outside_itself(tmp_path):
    recorded = json.loads((FIXTURE / "lerobot" / "config.json").read_text())["base_model_path"]
    out = tmp_path / "export"
    export_checkpoint(str(parity.round_trip_checkpoint(FIXTURE, tmp_path / "ck")), out)
    config = json.loads((out / "config.json").read_text())
    base = Path(config["base_model_path"])
    assert base == (out / "base").resolve()
    read = [out / "config.json", *out.glob("policy_*.json"), *(out / "eagle").glob("*.json"),
            *out.glob("base/*.json")]
    for file in read:
        text = file.read_text()
        for path in (recorded, str(REPO), str(FIXTURE), "tests/data"):
            assert path not in text, (file.name, path)
    # The base is an Isaac-GR00T checkpoint of the policy: its sizes and its weights.
    ckpt = read_checkpoint(base)
    assert ckpt.layout == "isaac"
    eagle = json.loads((out / "eagle" / "config.json").read_text())
    meta, t = parity.load_fixture(FIXTURE)
    policy = parity.fixture_policy(FIXTURE, meta, t)
    assert shapes_from_configs(PRESETS["groot_n15"], ckpt.groot_config, eagle) == policy.shapes
    ours = load_file(str(out / "model.safetensors"))
    theirs = load_file(str(base / "model.safetensors"))
    assert set(theirs) == {k.removeprefix("_groot_model.") for k in ours}
    for key, tensor in theirs.items():
        assert torch.equal(tensor, ours["_groot_model." + key]), key


def test_the_base_config_at_n15_sizes_is_the_published_one():
    from rlvla3.policies.groot.export import N15_HUB, base_model, isaac_config

    published = json.loads((REPO / "tests" / "data" / "groot_n15_keys.json").read_text())
    assert isaac_config(PRESETS["groot_n15"], GrootConfig(tune_visual=True)) == \
        published["groot_config"]
    n15 = SimpleNamespace(shapes=PRESETS["groot_n15"], cfg=GrootConfig(checkpoint="/ckpt/x"))
    assert base_model(n15) == N15_HUB  # LeRobot resolves it from the Hub or its cache


def test_eagle_assets_lerobot_would_download_are_refused(tmp_path):
    meta, t = parity.load_fixture(FIXTURE)
    eagle = tmp_path / "eagle"
    shutil.copytree(FIXTURE / "eagle", eagle)
    (eagle / "generation_config.json").unlink()
    options = {**parity.fixture_options(FIXTURE, meta), "tokenizer": str(eagle)}
    from rlvla3.checkpoint.files import CheckpointMeta, save_checkpoint
    from rlvla3.config import Named
    from rlvla3.policies.groot import build_groot_policy

    policy = build_groot_policy(parity.fixture_spec(meta, t), options)
    save_checkpoint(tmp_path / "ck", policy, CheckpointMeta(Named("groot", options),
                                                            policy.spec, 1))
    with pytest.raises(ExportError, match="lacks generation_config.json"):
        export_checkpoint(str(tmp_path / "ck"), tmp_path / "out")
    assert not (tmp_path / "out").exists()
