"""Reading a checkpoint safely: where it is, a trusted local copy of it, and its listed files.

Role: ``locate_checkpoint`` says where a checkpoint is (itself, or a run directory's
``latest``); ``resolve_checkpoint`` gives a local directory holding it, a remote one fetched
into this user's private cache and every file checked against the sizes and sha256 in
``meta.json``; ``open_listed`` opens a file only when ``meta.json`` lists it. The invariants
are those of ``rlvla3.checkpoint.files`` (reading).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from rlvla3.checkpoint.storage import (
    Storage,
    cache_name,
    discard,
    join,
    lstat_below,
    open_no_link,
    private_dir,
    scratch_dir,
    size_and_sha256,
)
from rlvla3.config import ConfigError


class CheckpointError(FileNotFoundError):
    """A checkpoint is missing, incomplete or does not match its own ``meta.json``."""


def locate_checkpoint(path: str | Path) -> str:
    """Where the checkpoint at ``path`` is: ``path`` itself, or the checkpoint a run directory's
    ``checkpoints/latest`` names (a local path or URI, nothing downloaded)."""
    store = Storage(path)
    if store.is_file("meta.json"):
        return store.uri
    try:
        name = store.read_text("checkpoints/latest").strip()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {store.uri} (expected meta.json or "
                              "checkpoints/latest)") from None
    ckpt = join(store.uri, "checkpoints", name)
    if not Storage(ckpt).is_file("meta.json"):
        raise CheckpointError(f"{store.uri}: checkpoints/latest names {name}, which holds no "
                              "complete checkpoint (no meta.json)")
    return ckpt


_FETCHED: dict[tuple[str, str], Path] = {}
"""Checkpoints this process has checked: (location, sha256 of meta.json) -> local directory."""
_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
"""One part of a file name a checkpoint may list (matched whole: ``fullmatch``, so not even a
final newline gets by): no separator, no leading dot (so no ``.``, ``..`` or hidden file), no
control character, no NUL."""
OPTIONAL_FILES = {
    "optimizer.pt": "the optimizer state, which only --resume needs",
    "rng.safetensors": "the learner's RNG state, which only --resume needs",
}
"""The files only continuing a run reads. Evaluating, exporting or starting a new run from a
checkpoint (``init_from``) needs its weights alone, so a checkpoint kept without these (the
results in the repository keep their weights only) still serves those uses."""
LAYOUT = ("policy.safetensors", *OPTIONAL_FILES)
"""The files of a whole checkpoint (``save_checkpoint``)."""


def checked_file_name(ckpt: str, name: Any) -> str:
    """``name`` as ``meta.json`` lists it, if it is a plain relative name inside the checkpoint
    (``policy.safetensors``, ``model/shard-0.distcp``), else ``CheckpointError`` naming it. The
    names come from whoever wrote the checkpoint: a name that is absolute, climbs out with
    ``..``, carries a backslash, a NUL or a control character, or names ``meta.json`` itself is
    refused before anything is written."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or len(parts) > 8 or name == "meta.json" or not all(
            _NAME_PART.fullmatch(p) for p in parts):
        raise CheckpointError(f"{ckpt}: meta.json lists a file named {name!r}, which is not a "
                              "plain relative name inside the checkpoint; refused")
    return name


def _inside(local: Path, name: str) -> Path:
    """``local / name``, refused when a directory on the way is a link out of ``local``."""
    target = local / name
    root = local.resolve()
    if not target.parent.resolve().is_relative_to(root) or target.is_symlink():
        raise CheckpointError(f"{local}: {name} resolves outside the checkpoint's directory "
                              "(a symbolic link on the way); refused")
    return target


def _listed(ckpt: str, raw: bytes) -> dict[str, dict[str, Any]] | None:
    """The files ``meta.json`` lists, each name checked (``checked_file_name``); None for a
    checkpoint written before checkpoints listed their files."""
    try:
        meta = json.loads(raw)
        files = meta.get("files")
    except (ValueError, AttributeError):
        raise CheckpointError(f"{ckpt}: meta.json is not a JSON object") from None
    if files is None:
        return None
    if not isinstance(files, dict):
        raise CheckpointError(f"{ckpt}: meta.json's files is not a mapping")
    for name, want in files.items():
        checked_file_name(ckpt, name)
        if not isinstance(want, dict) or not isinstance(want.get("size"), int):
            raise CheckpointError(f"{ckpt}: meta.json gives no size for {name!r}")
    if meta.get("format") != "sharded" and "policy.safetensors" not in files:
        raise CheckpointError(f"{ckpt}: meta.json does not list policy.safetensors (the "
                              "policy's weights)")
    return files


def _local_files(ckpt: str, local: Path, raw: bytes) -> dict[str, dict[str, Any]]:
    """The files of the checkpoint in the local directory ``local``: what its ``meta.json``
    (``raw``) lists. One written before checkpoints listed their files is read as holding the
    files of ``LAYOUT`` found in its directory (sizes as found); only a local path holds one,
    since ``resolve_checkpoint`` refuses to fetch it, so no cache ever serves a file of it."""
    files = _listed(ckpt, raw)
    if files is not None:
        return files
    found = {name: {"size": (local / name).stat().st_size} for name in LAYOUT
             if (local / name).is_file()}
    if "policy.safetensors" not in found:
        raise CheckpointError(f"{ckpt}: policy.safetensors (the policy's weights) is missing")
    return found


def _what(name: str) -> str:
    """What a checkpoint's file is for, in words."""
    if name == "policy.safetensors":
        return "the policy's weights"
    return OPTIONAL_FILES.get(name, "a shard of the weights and optimizer state")


def _missing(ckpt: str, name: str, want: dict[str, Any]) -> CheckpointError:
    return CheckpointError(f"{ckpt}: {name} ({_what(name)}) is missing; meta.json lists it "
                           f"({want['size']} bytes)")


def _sound_copy(local: Path, raw: bytes, files: dict[str, dict[str, Any]]) -> bool:
    """Whether ``local`` is a complete copy, made by this user, of the checkpoint whose
    ``meta.json`` is ``raw``: a directory of this user's that nobody else can write to (not a
    link), no link on the way to a listed file, and each listed file a regular file of this
    user's with its size and sha256, hashed now through a handle that follows no link (a
    process trusts only the last write it checked). A file without a listed sha256 cannot be
    checked again: such a copy is never reused. An optional file may be absent (the remote
    checkpoint had none: its reader says so if it is needed)."""
    uid = os.getuid()
    try:
        info = os.lstat(local)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
            return False
        with open_no_link(local / "meta.json") as handle:
            if handle.read() != raw:
                return False
        for name, want in files.items():
            found = lstat_below(local, name)
            if found is None and name in OPTIONAL_FILES:
                continue
            if (found is None or not stat.S_ISREG(found.st_mode) or found.st_uid != uid
                    or found.st_size != want["size"] or "sha256" not in want):
                return False
            with open_no_link(local / name) as handle:
                if size_and_sha256(handle) != (want["size"], want["sha256"]):
                    return False
    except (OSError, ValueError):
        return False
    return True


def _fetch(ckpt: str, store: Storage, raw: bytes, files: dict[str, dict[str, Any]]) -> Path:
    """A checked copy of the remote checkpoint ``ckpt`` in this user's private cache
    (``scratch_dir()/checkpoints``, ``private_dir``): the copy there when it is sound
    (``_sound_copy``), else one fetched afresh into a new directory of this user's, each file
    hashed as it is written and checked against ``meta.json``, and put in place of what was
    there. A bad copy (a changed file, a link inside it, a directory another user made) is
    replaced, never a reason to refuse: only a remote checkpoint that does not match its own
    ``meta.json`` is (``CheckpointError``)."""
    cache = private_dir(scratch_dir() / "checkpoints")
    local = cache / f"{cache_name(ckpt)}-{hashlib.sha256(raw).hexdigest()[:8]}"
    if _sound_copy(local, raw, files):
        return local
    fresh = Path(tempfile.mkdtemp(prefix=".fetch-", dir=cache))  # mode 0700, this user's
    try:
        for name, want in files.items():
            try:
                moved = store.download(name, fresh / name)
            except FileNotFoundError:
                if name in OPTIONAL_FILES:
                    continue  # its reader (open_listed) says so, if it is needed
                raise _missing(ckpt, name, want) from None
            if moved.size != want["size"] or want.get("sha256", moved.sha256) != moved.sha256:
                raise CheckpointError(f"{ckpt}: {name} does not match meta.json (size "
                                      f"{moved.size} vs {want['size']}, or its sha256)")
        (fresh / "meta.json").write_bytes(raw)  # written last: a complete, checked copy
        if not _sound_copy(local, raw, files):  # another process of this user's may be first
            discard(local)
            try:
                os.rename(fresh, local)
            except OSError:
                if not _sound_copy(local, raw, files):
                    raise CheckpointError(f"{local}: cannot put the fetched copy of {ckpt} "
                                          "in place") from None
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return local


def resolve_checkpoint(path: str | Path) -> Path:
    """A local directory holding the checkpoint at ``path`` (a checkpoint or run directory, a
    local path or URI): a local one as it is, a remote one fetched into this user's private
    cache (``_fetch``). Every file ``meta.json`` lists must be a plain relative name
    (``checked_file_name``); the weights must be listed and there; every listed file that is
    there must have its size (a local checkpoint) or its size and sha256 (a fetched one); else
    ``CheckpointError`` naming the file and what it is for. A listed optimizer or RNG state
    that is absent (``OPTIONAL_FILES``) is not an error here: evaluating, exporting and
    ``init_from`` need only the weights, and its reader (``open_listed``) names it when a
    resumed run needs it. A checkpoint whose ``meta.json`` lists no files (written before they
    were listed) loads from a local path only: fetched, nothing in it could be checked."""
    ckpt = locate_checkpoint(path)
    store = Storage(ckpt)
    raw = store.read_bytes("meta.json")
    key = (ckpt, hashlib.sha256(raw).hexdigest())
    if key in _FETCHED:
        return _FETCHED[key]
    if store.local:
        local = Path(store.root)
        for name, want in _local_files(ckpt, local, raw).items():
            file = _inside(local, name)
            if not file.is_file() and name in OPTIONAL_FILES:
                continue
            if not file.is_file():
                raise _missing(ckpt, name, want)
            if file.stat().st_size != want["size"]:
                raise CheckpointError(f"{ckpt}: {name} holds {file.stat().st_size} bytes, "
                                      f"meta.json lists {want['size']}")
    else:
        files = _listed(ckpt, raw)
        if files is None:
            raise CheckpointError(f"{ckpt}: meta.json lists no files (a checkpoint written "
                                  "before checkpoints listed them): nothing fetched from it "
                                  "could be checked; copy it to a local path to load it")
        local = _fetch(ckpt, store, raw, files)
    _FETCHED[key] = local
    return local


def open_listed(local: Path, name: str) -> BinaryIO | None:
    """The file ``name`` of the checkpoint in ``local`` (a directory ``resolve_checkpoint``
    gave) open for reading, when its ``meta.json`` lists it: opened following no link, its size
    and sha256 checked through that same handle, which is then rewound. None when the
    checkpoint does not list it: a file it does not list is never read, whatever its directory
    (a shared cache, a copy someone added to) holds. Listed but absent: ``CheckpointError``
    naming the file and what it is for."""
    want = _local_files(str(local), local, (local / "meta.json").read_bytes()).get(name)
    if want is None:
        return None
    try:
        handle = open_no_link(_inside(local, name))
    except FileNotFoundError:
        raise _missing(str(local), name, want) from None
    except OSError as exc:  # ELOOP: a link
        raise CheckpointError(f"{local}: {name} cannot be opened as a plain file "
                              f"({exc.strerror}); refused") from None
    size, sha256 = size_and_sha256(handle)
    if size != want["size"] or want.get("sha256", sha256) != sha256:
        handle.close()
        raise CheckpointError(f"{local}: {name} does not match meta.json (size {size} vs "
                              f"{want['size']}, or its sha256: changed since it was saved)")
    handle.seek(0)
    return handle


def listed_files(path: str | Path) -> dict[str, dict[str, Any]]:
    """The files a checkpoint's ``meta.json`` lists (name -> size, sha256); empty for a
    checkpoint written before they were listed."""
    ckpt = locate_checkpoint(path)
    return _listed(ckpt, Storage(ckpt).read_bytes("meta.json")) or {}


def check_present(ckpt: str, field: str, everything: bool) -> None:
    """Before anything starts (one listing of the checkpoint's directory, nothing fetched):
    the files a use of ``ckpt`` needs are there with the sizes ``meta.json`` lists, its weights
    or, with ``everything``, every file it lists (continuing its run); else
    ``ConfigError(field, ...)`` naming the first one missing and what it is for."""
    store = Storage(ckpt)
    raw = store.read_bytes("meta.json")
    try:
        files = (_local_files(ckpt, Path(store.root), raw) if store.local
                 else _listed(ckpt, raw))
        if files is None:
            raise CheckpointError(f"{ckpt}: meta.json lists no files (a checkpoint written "
                                  "before checkpoints listed them): copy it to a local path "
                                  "to load it")
        sizes = store.sizes()
        for name, want in files.items():
            if name not in sizes and (everything or name not in OPTIONAL_FILES):
                raise _missing(ckpt, name, want)
            if name in sizes and sizes[name] != want["size"]:
                raise CheckpointError(f"{ckpt}: {name} holds {sizes[name]} bytes, meta.json "
                                      f"lists {want['size']}")
    except CheckpointError as exc:
        raise ConfigError(field, str(exc)) from None
