"""Where runs keep their files: a local path or a filesystem URI behind one small interface.

A run keeps its checkpoints, ``config.yaml``, ``summary.json``, ``metrics.jsonl``, TensorBoard
events and evaluation outputs under one *storage* location: a local path (the default, for a
laptop), a shared mount every node sees (NFS; declared with ``storage.shared``), or a URI:
``s3://bucket/prefix``, ``gs://``, ``hdfs://`` through pyarrow's own filesystems, or any other
fsspec protocol (``abfs://``, ``memory://``, ...) wrapped with ``FSSpecHandler``. The data lake
reads datasets through the same ``resolve_filesystem``.

- ``Storage(uri)``: a directory on such a filesystem. Reads, writes that are whole or absent
  (a local or HDFS file is written beside its name and renamed; an object store makes an object
  visible only once its upload completes), listings, deletes, and streamed transfers to and from
  local files that return the size and sha256 of what they moved.
- ``Mirror(uri)``: a storage directory with a working copy on this node's disk, for files that
  grow (``metrics.jsonl``, TensorBoard events, ``episodes.jsonl``): they are written locally and
  copied up by ``push`` (every ``every_s`` through ``sync``); files named in ``keep`` are pulled
  down first, so a resumed run appends to its own history. A local storage *is* its working copy;
  a remote one gets a fresh directory in the scratch cache (dropped by ``close``).
- ``scratch_dir()``: this user's cache on this node (``RLVLA3_SCRATCH``, else
  ``<tmp>/rlvla3-scratch-<uid>``). Nothing a run keeps lives only there: it is a cache of what
  storage holds and a staging area for uploads. It must be this user's own (``private_dir``):
  a directory another user of the node could write to would let them plant or swap files
  between a download's check and its use, or in a staged upload. ``open_no_link``,
  ``lstat_below`` and ``discard`` read, check and remove what is in it without following a
  link.

Credentials never pass through here: pyarrow and fsspec read them from the environment (for S3:
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` for an S3-compatible server,
or an instance role); a URI carrying a secret is refused by ``StorageConfig``.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import stat
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rlvla3.config import ConfigError, require

SCRATCH_ENV = "RLVLA3_SCRATCH"
CHUNK = 64 << 20
"""Bytes per read in streamed transfers (on an object store, one ranged GET each: fewer,
larger requests)."""
SECRET_KEYS = ("secret_key", "access_key", "session_token", "token", "password", "sas_token",
               "sig", "signature", "access_token", "account_key", "x-amz-signature",
               "x-amz-credential", "x-amz-security-token", "x-goog-signature",
               "x-goog-credential")
"""URI query options that carry credentials (refused: config.yaml and logs would show them):
S3 and fsspec keys, an Azure SAS's ``sig``, a GCS ``access_token``, pre-signed URL signatures."""
S3_REQUEST_TIMEOUT_S = 120.0
"""How long an S3 request may wait for its reply. Completing the multipart upload of a large
file takes a server a while (tens of seconds for a GB on a small one); with the AWS SDK's
default (3 s) the client retries a completion still under way, and the retries can fail it."""
_OBJECT_STORES = ("s3", "gcs")
"""pyarrow filesystems with no rename, where an object appears whole when its upload ends."""


@dataclass(frozen=True)
class StorageConfig:
    """Where a run keeps its files."""

    root: str = "runs"
    """A local path or URI (``s3://bucket/runs``, ``gs://...``, ``hdfs://...``, any fsspec
    protocol); each run is a directory under it, ``<root>/<name or timestamp>``."""
    shared: bool = False
    """Declare a local ``root`` visible from every node (an NFS or other shared mount). Without
    it, a run on a cluster of more than one node is refused when ``root`` is a local path."""
    sync_every_s: float = 30.0
    """How often files that grow (``metrics.jsonl``, TensorBoard events) are copied to a remote
    storage during a run; always at its end. No effect on a local storage."""

    def validate(self) -> None:
        require(bool(self.root), "root", "must name a local path or a URI")
        require(self.sync_every_s >= 0, "sync_every_s", "must be >= 0")
        check_no_secret(self.root, "root")


def check_no_secret(uri: str, field: str) -> None:
    """Refuse a URI that carries a credential: it would be written to config.yaml and logs."""
    if "://" not in uri:
        return
    parts = urlsplit(uri)
    secret = [k for k in parse_qs(parts.query) if k.lower() in SECRET_KEYS]
    if secret or parts.password:
        raise ConfigError(field, f"the URI carries a credential ({(secret or ['password'])[0]}): "
                          "credentials come from the environment (AWS_ACCESS_KEY_ID, "
                          "AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, an instance "
                          "role), never from a URI that config.yaml and logs would show")


def is_uri(location: str | Path) -> bool:
    """Whether ``location`` names a filesystem by scheme (``file://`` counts as one)."""
    return "://" in str(location)


def join(location: str | Path, *parts: str) -> str:
    """``location`` with ``parts`` appended, keeping a URI's scheme and query options."""
    text = str(location)
    if not is_uri(text):
        return str(Path(text).joinpath(*parts))
    base, sep, query = text.partition("?")
    return posixpath.join(base, *parts) + sep + query


def basename(location: str | Path) -> str:
    """The last component of a path or URI (its query options left out)."""
    return posixpath.basename(str(location).partition("?")[0].rstrip("/"))


def parent(location: str | Path) -> str:
    """The directory that holds ``location`` (a URI keeps its scheme and query options)."""
    text = str(location)
    if not is_uri(text):
        return str(Path(text).parent)
    base, sep, query = text.partition("?")
    return posixpath.dirname(base.rstrip("/")) + sep + query


def resolve_filesystem(uri: str | Path) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it for a local path or any filesystem URI.

    pyarrow's own schemes (file, s3, gs, hdfs, ...) are used directly (for S3 it honours
    ``AWS_ENDPOINT_URL`` and URI options such as ``?endpoint_override=host:port&scheme=http``);
    other fsspec protocols (memory://, abfs://, ...) are wrapped with ``FSSpecHandler`` so the
    same code reads both."""
    text = str(uri)
    if not is_uri(text):
        return pafs.LocalFileSystem(), str(Path(text).resolve())
    try:
        fs, path = pafs.FileSystem.from_uri(text)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        if "Unrecognized filesystem type" not in str(exc):  # pyarrow's own scheme, bad URI
            raise ValueError(f"{text}: {exc}") from None
        import fsspec

        fs, path = fsspec.core.url_to_fs(text)
        return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
    if fs.type_name == "s3":  # the same options, but a reply may take a while (see below)
        build, (options,) = fs.__reduce__()
        fs = build({**options, "request_timeout": S3_REQUEST_TIMEOUT_S})
    return fs, path


def scratch_dir() -> Path:
    """This user's cache and staging directory on this node (``RLVLA3_SCRATCH`` or
    ``<tmp>/rlvla3-scratch-<uid>``), made or checked by ``private_dir``."""
    default = Path(tempfile.gettempdir()) / f"rlvla3-scratch-{os.getuid()}"
    return private_dir(Path(os.environ.get(SCRATCH_ENV) or default))


def private_dir(path: Path) -> Path:
    """``path``, a directory only this user can change: made with mode 0700 where it is
    absent; one that exists must be a directory (not a link to one) that this user owns and
    that neither its group nor others can write to, in a parent nobody else can rename it out
    of (not writable by group or others, or sticky as ``/tmp`` is). Else ``PermissionError``,
    one line naming the directory and what is wrong with it. Checked with ``lstat``: no link
    is followed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass  # checked below, as found
    except OSError as exc:
        raise PermissionError(f"{path}: cannot make a directory there ({exc.strerror}); set "
                              f"{SCRATCH_ENV} to a directory of your own") from None
    info, above = os.lstat(path), os.stat(path.parent)
    if stat.S_ISLNK(info.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        why = "is not a directory"
    elif info.st_uid != os.getuid():
        why = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    elif info.st_mode & 0o022:
        why = f"can be written by other users (mode {stat.S_IMODE(info.st_mode):04o})"
    elif (above.st_mode & 0o022 or above.st_uid not in (0, os.getuid())) and not (
            above.st_mode & stat.S_ISVTX):
        why = (f"sits in {path.parent}, where another user can rename it (mode "
               f"{stat.S_IMODE(above.st_mode):04o}, uid {above.st_uid}, not sticky)")
    else:
        return path
    raise PermissionError(f"{path} {why}: a scratch directory must be this user's own (set "
                          f"{SCRATCH_ENV} to a directory of yours)")


def file_sha256(path: Path) -> str:
    """The sha256 of a local file, read in chunks (a checkpoint's ``meta.json`` records it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def open_no_link(path: Path) -> BinaryIO:
    """``path`` open for reading, refused (``OSError``) where its last part is a link."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def size_and_sha256(handle: BinaryIO) -> tuple[int, str]:
    """Size and sha256 of what ``handle`` reads from where it stands to its end."""
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def lstat_below(root: Path, name: str) -> os.stat_result | None:
    """``lstat`` of ``root/name``, None where it is absent; ``ValueError`` where a directory on
    the way is a link or not a directory (no link is followed)."""
    here = root
    parts = name.split("/")
    try:
        for part in parts[:-1]:
            here = here / part
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                raise ValueError(f"{here} is not a directory")
        return os.lstat(here / parts[-1])
    except FileNotFoundError:
        return None


def discard(path: Path) -> None:
    """Take whatever is at ``path`` out of the way (a file, a link, a directory, whoever made
    it), following no link: a directory is renamed aside first, so no reader finds half of it,
    then removed as far as this user may."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(path)
        return
    aside = path.with_name(f".discard-{uuid.uuid4().hex}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def cache_name(uri: str) -> str:
    """A directory name for ``uri`` in the scratch cache: readable and unique."""
    tail = re.sub(r"[^A-Za-z0-9._-]+", "_", basename(uri))[-40:]
    return f"{tail}-{hashlib.sha256(uri.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class Moved:
    """What a streamed transfer moved."""

    size: int
    sha256: str


class Storage:
    """A directory at a local path or URI; names below it are ``/``-separated relative paths."""

    def __init__(self, uri: str | Path):
        check_no_secret(str(uri), "storage URI")  # whatever flag or field it came from
        self.fs, self.root = resolve_filesystem(uri)
        self.uri = self.root if isinstance(self.fs, pafs.LocalFileSystem) else str(uri).rstrip("/")
        """The location as given (a URI), or the absolute path of a local directory."""

    @property
    def local(self) -> bool:
        """Whether this is a directory on this machine's filesystem."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def __str__(self) -> str:
        return self.uri

    def path(self, name: str = "") -> str:
        """The path of ``name`` inside the filesystem."""
        return posixpath.join(self.root, name) if name else self.root

    def child(self, name: str) -> Storage:
        return Storage(join(self.uri, name))

    # ---- reading -------------------------------------------------------------------------
    def kind(self, name: str = "") -> pafs.FileType:
        return self.fs.get_file_info(self.path(name)).type

    def is_file(self, name: str) -> bool:
        return self.kind(name) == pafs.FileType.File

    def exists(self, name: str = "") -> bool:
        return self.kind(name) != pafs.FileType.NotFound

    def read_bytes(self, name: str) -> bytes:
        try:
            with self.fs.open_input_stream(self.path(name)) as f:
                return f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"no file {join(self.uri, name)}") from None

    def read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (one ranged read on an object store)."""
        with self.fs.open_input_file(self.path(name)) as f:
            return f.read_at(length, offset)

    def sizes(self, name: str = "") -> dict[str, int]:
        """Every file below ``name`` (recursively): relative path -> size in bytes."""
        base = self.path(name)
        infos = self.fs.get_file_info(pafs.FileSelector(base, recursive=True,
                                                        allow_not_found=True))
        return {posixpath.relpath(i.path, base): i.size for i in infos
                if i.type == pafs.FileType.File}

    def listdir(self, name: str = "") -> list[str]:
        """Names directly below ``name`` (files and directories), sorted."""
        base = self.path(name)
        infos = self.fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
        return sorted(posixpath.basename(i.path.rstrip("/")) for i in infos)

    # ---- writing -------------------------------------------------------------------------
    def _prepare(self, name: str) -> str:
        path = self.path(name)
        if self.fs.type_name not in _OBJECT_STORES:  # object stores have no directories
            self.fs.create_dir(posixpath.dirname(path), recursive=True)
        return path

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``name`` whole: a reader sees the old content or the new, never a part."""
        path = self._prepare(name)
        if self.fs.type_name in _OBJECT_STORES:
            with self.fs.open_output_stream(path) as f:
                f.write(data)
            return
        tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        self.fs.move(tmp, path)

    def write_text(self, name: str, text: str) -> None:
        self.write_bytes(name, text.encode())

    def delete(self, name: str) -> None:
        """Remove a file or a directory with everything below it (absent: nothing to do)."""
        kind = self.kind(name)
        if kind == pafs.FileType.Directory:
            self.fs.delete_dir(self.path(name))
        elif kind == pafs.FileType.File:
            self.fs.delete_file(self.path(name))

    def upload(self, local: Path, name: str) -> Moved:
        """Stream a local file to ``name``; on an object store it appears once complete."""
        digest, size = hashlib.sha256(), 0
        with open(local, "rb") as src, self.fs.open_output_stream(self._prepare(name)) as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
                dst.write(chunk)
        return Moved(size, digest.hexdigest())

    def download(self, name: str, local: Path) -> Moved:
        """Stream ``name`` to a local file (written beside it, then renamed into place)."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f"{local.name}.{uuid.uuid4().hex[:8]}.part")
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open_input_stream(self.path(name)) as src, open(tmp, "wb") as dst:
                while chunk := src.read(CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
            os.replace(tmp, local)
        finally:
            tmp.unlink(missing_ok=True)
        return Moved(size, digest.hexdigest())


class Mirror:
    """A storage directory with a working copy on this node (see the module docstring)."""

    def __init__(self, uri: str | Path, keep: Sequence[str] = (), every_s: float = 0.0):
        self.storage = Storage(uri)
        self.every_s = every_s
        if self.storage.local:
            self.local = Path(self.storage.root)
        else:  # a working copy of its own: it starts from what storage holds, nothing stale
            name = f"{cache_name(self.storage.uri)}-{uuid.uuid4().hex[:6]}"
            self.local = scratch_dir() / "mirror" / name
            self.local.mkdir(parents=True)
        self._pushed: dict[str, tuple[int, int]] = {}
        self._last_sync = time.monotonic()
        for name in keep:
            self.pull(name)

    @property
    def uri(self) -> str:
        return self.storage.uri

    @property
    def remote(self) -> bool:
        return not self.storage.local

    def pull(self, name: str) -> bool:
        """Copy ``name`` down from storage when it is there; returns whether it was."""
        if not self.remote or not self.storage.is_file(name):
            return False
        self.storage.download(name, self.local / name)
        self._pushed[name] = _stamp(self.local / name)
        return True

    def write_text(self, name: str, text: str) -> None:
        """Write a whole file to the working copy and to storage."""
        path = self.local / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        self.push(name)

    def push(self, *names: str) -> int:
        """Copy the named files (directories: every file below them; none named: the whole
        working copy) that changed since the last push up to storage; returns how many."""
        if not self.remote:
            return 0
        copied = 0
        for name in names or (".",):
            top = self.local / name
            files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file())
            for file in files:
                rel = file.relative_to(self.local).as_posix()
                stamp = _stamp(file)
                if self._pushed.get(rel) != stamp:
                    self.storage.upload(file, rel)
                    self._pushed[rel] = stamp
                    copied += 1
        self._last_sync = time.monotonic()
        return copied

    def sync(self, *names: str) -> int:
        """``push`` at most every ``every_s`` seconds."""
        if time.monotonic() - self._last_sync < self.every_s:
            return 0
        return self.push(*names)

    def close(self) -> None:
        """Drop a remote storage's working copy (push what must be kept first)."""
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def check_reach(location: str, shared: bool, nodes: int, can_grow: bool, field: str) -> None:
    """Refuse a local storage path that not every node of a cluster can see: on a cluster of
    more than one node (or one an autoscaler can grow), checkpoints written on the learner's
    node would be missing for a learner restarted elsewhere, for ``--resume`` and for eval."""
    if shared or (is_uri(location) and not location.startswith("file://")):
        return
    if nodes > 1 or can_grow:
        size = f"{nodes} nodes" if nodes > 1 else "1 node and an autoscaler that adds more"
        raise ConfigError(field, (
            f"{location} is a local path and this cluster has {size}: each node would keep its "
            f"own files (a learner restarted on another node, --resume and eval would not find "
            f"its checkpoints); use a URI every node reaches (--storage s3://BUCKET/runs, "
            f"gs://..., hdfs://...) or, for a mount every node shares (NFS), set "
            f"storage.shared=true"))


def check_writable(location: str | Path, field: str) -> None:
    """Before a job starts anything: that ``location`` (a run or output directory) can be
    written, so that a bucket that does not exist, missing credentials or a read-only
    directory is ``ConfigError(field, ...)``, one line, instead of a failure at the job's first
    save. A remote location gets a small file written and deleted; a local one is checked
    where it exists, or its nearest existing parent, and nothing is created."""
    store = Storage(location)
    if store.local:
        path = Path(store.root)
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(field, f"cannot write to {location}: {path} is not a directory "
                                     "this user can write to")
        return
    probe = f".write-check-{uuid.uuid4().hex[:8]}"
    try:
        store.write_bytes(probe, b"")
        store.delete(probe)
    except OSError as exc:
        reason = " ".join(str(exc).split()).split(" (Request ID")[0]
        raise ConfigError(field, f"cannot write to {location}: {reason}") from None
