"""A checkpoint from a stranger can at worst fail to load: the file names its ``meta.json``
lists are checked before anything is written (no ``..``, no absolute path, no NUL, no final
newline, no link out of the directory), a reader opens only the files ``meta.json`` lists,
downloads go to a scratch directory that is this user's own (another user's directory, a
writable one or a link is refused in one line), a cached copy is re-checked against the hashes
before it is trusted and fetched afresh when it is bad (a changed file, a link inside it, a
directory another user made), and URIs that carry a credential are refused. Another user is
played by ``os.chown`` to uid 12345 (the tests run as root where they can).

The remote checkpoints live on fsspec's in-memory filesystem (``memory://``): the same
``Storage`` code path as ``s3://`` without a server.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rlvla3.algos.config import AlgoConfig
from rlvla3.checkpoint import trust
from rlvla3.checkpoint.files import (
    CheckpointMeta,
    StateSnapshot,
    load_optimizer_state,
    load_policy,
    load_rng_state,
    row_source,
    save_checkpoint,
)
from rlvla3.checkpoint.storage import SCRATCH_ENV, Storage, check_no_secret, scratch_dir
from rlvla3.checkpoint.trust import CheckpointError, resolve_checkpoint
from rlvla3.config import ConfigError, Named
from rlvla3.learner.core import rl_engine
from rlvla3.policies import build_policy
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
    "policy.pt\n", "shards/x\n",
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
    trust._FETCHED.clear()  # a new process on the node
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


LR = 3e-4
"""The learning rate the restoring learner is configured with."""


def _planted_optimizer(lr: float, where: Path) -> bytes:
    """A real optimizer state of the SMALL policy whose learning rate is ``lr``."""
    policy = build_policy(SMALL, SPEC)
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    path = where / "planted.pt"
    torch.save(optimizer.state_dict(), path)
    return path.read_bytes()


def _restored_lr(where: str | Path) -> float:
    """The learning rate of a learner that resumes (optimizer state included) from
    ``where``, as the learner rank does (``row_source``)."""
    policy = build_policy(SMALL, SPEC)
    engine = rl_engine(policy, AlgoConfig("grpo"), LR)
    engine.restore(row_source(where, optimizer=True), optimizer=True)
    return engine.optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("remote", [True, False], ids=["cached copy", "local checkpoint"])
def test_a_file_the_checkpoint_does_not_list_is_never_read(remote, tmp_path, monkeypatch):
    """An ``optimizer.pt`` (learning rate 123) and an ``rng.safetensors`` planted beside a
    checkpoint saved without them, in the cached copy of a remote one or in a local one: a
    resumed learner keeps its own learning rate and no reader returns them."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
    if remote:
        where: str | Path = _remote_checkpoint("unlisted")
        local = resolve_checkpoint(where)
    else:
        where = local = tmp_path / "ckpt"
        save_checkpoint(where, build_policy(SMALL, SPEC), CheckpointMeta(SMALL, SPEC, 1))
    (local / "optimizer.pt").write_bytes(_planted_optimizer(123.0, tmp_path))
    save_file({"torch": torch.zeros(5056, dtype=torch.uint8)}, str(local / "rng.safetensors"))
    trust._FETCHED.clear()  # a new process on the node
    assert _restored_lr(where) == LR
    assert load_optimizer_state(where) is None and load_rng_state(where) is None


def test_a_listed_optimizer_state_is_restored(tmp_path, monkeypatch):
    """The other side of the test above: the optimizer state a checkpoint lists reaches a
    resumed learner (its learning rate and Adam moments), from a local or a cached copy."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
    policy = build_policy(SMALL, SPEC)
    optimizer = torch.optim.Adam(policy.parameters(), lr=5e-5)
    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    uri = f"memory://trust/listed-{os.getpid()}"
    for where in (tmp_path / "ckpt", uri):
        save_checkpoint(where, policy, CheckpointMeta(SMALL, SPEC, 1), optimizer)
        assert _restored_lr(where) == 5e-5
        saved = load_optimizer_state(where)
        assert saved is not None and len(saved["state"]) == len(list(policy.parameters()))


def test_the_scratch_directory_must_be_this_users_own(tmp_path, monkeypatch):
    """One line naming the directory and what is wrong, for each way another user could
    reach into it; a fresh one is made private (mode 0700)."""
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "writer"))
    uri = _remote_checkpoint("scratch")
    fresh = tmp_path / "fresh"
    monkeypatch.setenv(SCRATCH_ENV, str(fresh))
    assert scratch_dir() == fresh and (fresh.stat().st_mode & 0o777) == 0o700
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cases = {"belongs to uid 12345": lambda d: (d.mkdir(mode=0o700), os.chown(d, 12345, -1)),
             "can be written by other users (mode 0777)": lambda d: (d.mkdir(), d.chmod(0o777)),
             "is a symbolic link": lambda d: d.symlink_to(elsewhere, target_is_directory=True)}
    if os.getuid() != 0:
        cases.pop("belongs to uid 12345")  # only root can give a directory away
    for why, make in cases.items():
        scratch = tmp_path / f"scratch-{len(why)}"
        make(scratch)
        monkeypatch.setenv(SCRATCH_ENV, str(scratch))
        trust._FETCHED.clear()
        with pytest.raises(PermissionError) as err:
            resolve_checkpoint(uri)
        line = str(err.value)
        assert "\n" not in line and str(scratch) in line and why in line, line
        assert SCRATCH_ENV in line
    assert not any(elsewhere.iterdir())  # nothing went through the link
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by all, not sticky: anyone could swap a directory in it
    monkeypatch.setenv(SCRATCH_ENV, str(shared / "mine"))
    with pytest.raises(PermissionError, match="where another user can rename it"):
        resolve_checkpoint(uri)
    shared.chmod(0o1777)  # sticky, as /tmp is: only the owner renames what is in it
    trust._FETCHED.clear()
    assert resolve_checkpoint(uri).is_relative_to(shared / "mine")


def _cached(uri: str) -> Path:
    """The cached copy of ``uri``, made by a first process; the next call is a new one."""
    local = resolve_checkpoint(uri)
    trust._FETCHED.clear()
    return local


@pytest.mark.parametrize("bad", ["weights a link", "meta.json a link", "copy is a link",
                                 "copy of another user", "file of another user"])
def test_a_bad_cached_copy_is_fetched_afresh(bad, tmp_path, monkeypatch):
    """A link inside a cached copy, a copy that is itself a link, or a copy or file another
    user made: the next process does not use it (nothing read through the link, no
    ``CheckpointError`` forever on that node): it fetches the checkpoint afresh."""
    if "another user" in bad and os.getuid() != 0:
        pytest.skip("only root can give a file away")
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
    uri = _remote_checkpoint("bad-copy")
    local = _cached(uri)
    good = (local / "policy.safetensors").read_bytes()
    stranger = tmp_path / "stranger"
    planted = StateSnapshot({k: torch.full_like(v, 7.0)
                             for k, v in build_policy(SMALL, SPEC).state_dict().items()})
    save_checkpoint(stranger, planted, CheckpointMeta(SMALL, SPEC, 1))
    (stranger / "meta.json").write_bytes((local / "meta.json").read_bytes())
    if bad == "weights a link":
        (local / "policy.safetensors").unlink()
        (local / "policy.safetensors").symlink_to(stranger / "policy.safetensors")
    elif bad == "meta.json a link":  # the same bytes, through a link: not this user's copy
        (local / "meta.json").unlink()
        (local / "meta.json").symlink_to(stranger / "meta.json")
    elif bad == "copy is a link":
        (stranger / "policy.safetensors").write_bytes(good)  # the same bytes, through a link
        shutil.rmtree(local)
        local.symlink_to(stranger, target_is_directory=True)
    elif bad == "copy of another user":
        os.chown(local, 12345, -1)
    else:
        os.chown(local / "policy.safetensors", 12345, -1)
    policy, _ = load_policy(uri)  # no CheckpointError: fetched afresh
    again = resolve_checkpoint(uri)
    assert again == local and not again.is_symlink() and again.stat().st_uid == os.getuid()
    for file in again.rglob("*"):  # this user's own files, none a link
        assert not file.is_symlink() and file.lstat().st_uid == os.getuid(), file
    assert (again / "policy.safetensors").read_bytes() == good
    assert not any(torch.equal(v, torch.full_like(v, 7.0))
                   for v in policy.state_dict().values() if v.numel() > 1)
    assert (stranger / "policy.safetensors").exists()  # the link was removed, not its target
