"""A checkpoint from a stranger can at worst fail to load: the file names its ``meta.json``
lists are checked before anything is written (no ``..``, no absolute path, no NUL, no link out
of the directory), a cached copy in the node's shared scratch directory is re-checked against
the hashes before it is trusted, and URIs that carry a credential are refused.

The remote checkpoints live on fsspec's in-memory filesystem (``memory://``): the same
``Storage`` code path as ``s3://`` without a server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlvla3.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    StateSnapshot,
    load_policy,
    resolve_checkpoint,
    save_checkpoint,
)
from rlvla3.config import ConfigError, Named
from rlvla3.policies import build_policy
from rlvla3.storage import SCRATCH_ENV, Storage, check_no_secret
from rlvla3.types import EnvSpec

SPEC = EnvSpec(cameras=("cam",), image_size=(16, 16), state_dim=3, action_dim=2, chunk_len=1,
               max_decisions=10, num_tasks=1, num_init_states=4)
SMALL = Named("small", {"channels": 4, "hidden": 16})


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _remote_checkpoint(name: str) -> str:
    uri = f"memory://trust/{name}-{os.getpid()}-{id(name)}"
    save_checkpoint(uri, build_policy(SMALL, SPEC), CheckpointMeta(SMALL, SPEC, 1))
    return uri


def _list_file(uri: str, listed: str, data: bytes = b"owned") -> None:
    """Make the checkpoint at ``uri`` list one more file named ``listed`` (and hold it, where
    the name can be stored at all)."""
    store = Storage(uri)
    try:
        if listed != "meta.json":
            store.write_bytes(listed, data)
    except (OSError, ValueError):
        pass  # a name the store cannot hold: meta.json lists it all the same
    meta = json.loads(store.read_text("meta.json"))
    meta["files"][listed] = {"size": len(data)}
    store.write_text("meta.json", json.dumps(meta))


@pytest.mark.parametrize("listed", [
    "../x", "../../outside/.bashrc", "ABSOLUTE", "sub/../../x", "./policy.pt",
    "name\x00with-nul", "dir\\..\\x", ".hidden", "", "meta.json", "a//b", "link -> ../x",
])
def test_a_remote_checkpoint_that_lists_an_unsafe_name_is_refused_before_any_write(
        listed, tmp_path, monkeypatch):
    scratch, outside = tmp_path / "scratch", tmp_path / "outside"
    outside.mkdir()
    absolute = tmp_path / "absolute-target"
    listed = str(absolute) if listed == "ABSOLUTE" else listed  # an absolute path of this test's
    monkeypatch.setenv(SCRATCH_ENV, str(scratch))
    uri = _remote_checkpoint("unsafe")
    _list_file(uri, listed)
    before = _files_under(tmp_path)
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(uri)
    line = str(err.value)
    assert "\n" not in line and repr(listed) in line and "refused" in line
    written = _files_under(tmp_path) - before
    assert all(w.startswith("scratch") for w in written), written  # nothing outside scratch
    assert not any("policy.safetensors" in w for w in written)  # refused before any download
    assert not absolute.exists()


def test_a_local_checkpoint_whose_directory_links_outside_is_refused(tmp_path):
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes(b"12345")
    save_checkpoint(ckpt, build_policy(SMALL, SPEC), CheckpointMeta(SMALL, SPEC, 1))
    (ckpt / "model").symlink_to(elsewhere, target_is_directory=True)
    _list_file(str(ckpt), "model/w.bin", b"12345")
    with pytest.raises(CheckpointError, match="outside the checkpoint's directory"):
        resolve_checkpoint(ckpt)


def test_a_cached_copy_is_checked_again_before_it_is_trusted(tmp_path, monkeypatch):
    """Anyone who can write to the shared scratch directory could plant weights in a cached
    copy; the next process re-checks the copy's hashes and downloads it afresh."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
    uri = _remote_checkpoint("cached")
    local = resolve_checkpoint(uri)
    good = (local / "policy.safetensors").read_bytes()
    planted = StateSnapshot({k: torch.full_like(v, 7.0)
                             for k, v in build_policy(SMALL, SPEC).state_dict().items()})
    stranger = tmp_path / "stranger"
    save_checkpoint(stranger, planted, CheckpointMeta(SMALL, SPEC, 1))
    bad = (stranger / "policy.safetensors").read_bytes()
    assert len(bad) == len(good) and bad != good
    (local / "policy.safetensors").write_bytes(bad)  # same size, other weights
    from rlvla3 import checkpoint
    checkpoint._FETCHED.clear()  # a new process on the node
    policy, _ = load_policy(uri)
    assert (local / "policy.safetensors").read_bytes() == good
    assert not any(torch.equal(v, torch.full_like(v, 7.0))
                   for v in policy.state_dict().values() if v.numel() > 1)


@pytest.mark.parametrize("uri", [
    "abfs://container/runs?sv=2024&sig=abcdef",
    "gs://bucket/runs?access_token=ya29.x",
    "s3://bucket/runs?X-Amz-Signature=deadbeef",
    "s3://bucket/runs?x-amz-security-token=abc",
])
def test_uris_with_a_credential_are_refused(uri):
    with pytest.raises(ConfigError, match="carries a credential"):
        check_no_secret(uri, "init_from")
