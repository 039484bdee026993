"""Sharded checkpoints: every rank writes its own shard, in parallel, and any number of ranks
reads them back.

Layout inside one checkpoint directory (``rlvla3.checkpoint.files``'s protocol is kept: files first,
``meta.json`` listing every file with its size and sha256 last, then ``latest``)::

    shards/rank-00000-of-00002.safetensors   this rank's rows of every sharded tensor, and
    shards/rank-00001-of-00002.safetensors   (rank 0) every replicated one
    meta.json                                ``format: sharded``, the world size, each key's
                                             global shape, the optimizer's param groups

Keys are ``model/<name>`` (parameters and buffers), ``optim/<name>/<state>`` (the optimizer
state of parameter ``<name>``: Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) and, for an RL
learner with a proximal copy, ``shadow/<name>`` (that copy's parameters and buffers). A tensor sharded
on dim 0 (an FSDP2 DTensor) is stored as the rows its rank holds, with their offset in the
safetensors header; anything else is stored once, by rank 0. Nothing is pickled: safetensors
and JSON only.

Reading (``RowSource``): the rows ``[start, end)`` of any key, from a sharded checkpoint
(read from every shard file that overlaps them: a checkpoint of 2 ranks restores onto 3) or
from a whole one (``policy.safetensors``, and the optimizer state its checkpoint lists, read
by ``rlvla3.checkpoint.files.row_source`` when it is to be restored), so restoring, resharding and
consolidating for evaluation are the same operation. Only files ``meta.json`` lists are read.

Invariants: a shard file holds only the rows of its rank; the union of the files' rows of a
key is the whole tensor, without overlap; ``meta.json`` is written by rank 0 after every rank's
files are uploaded and checked.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlvla3.checkpoint.storage import file_sha256
from rlvla3.engine.group import Ranks

FORMAT = "sharded"
SHARDS = "shards"
SHADOW = "shadow"
"""The key prefix of an RL learner's proximal copy of the policy (``shadow/<name>``)."""
SHADOW_FILE = "shadow.safetensors"
"""The file of that copy in a whole checkpoint."""


def shard_name(rank: int, world: int) -> str:
    return f"{SHARDS}/rank-{rank:05d}-of-{world:05d}.safetensors"


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows of dim 0 that ``rank`` of ``world`` holds under FSDP2's ``Shard(0)`` (torch.chunk:
    ``ceil(rows / world)`` each, the last ones shorter or empty)."""
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def local_rows(tensor: torch.Tensor, ranks: Ranks) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """``(the rows this rank holds, their offset in dim 0, the global shape)`` of a parameter,
    buffer or optimizer state: a DTensor sharded on dim 0 gives its local rows, anything else
    (replicated) the whole tensor at offset 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, 0, tuple(tensor.shape)
    shape = tuple(tensor.shape)
    start, _ = row_range(shape[0], ranks.rank, ranks.world) if shape else (0, 0)
    return tensor.to_local(), start, shape


@dataclass(frozen=True)
class ShardWritten:
    """What one rank wrote."""

    name: str
    size: int
    sha256: str
    keys: dict[str, list[int]]
    """Key -> global shape (every key the rank wrote)."""


def write_shard(stage: Path, tensors: Mapping[str, torch.Tensor], ranks: Ranks) -> ShardWritten:
    """This rank's shard file in ``stage``: the local rows of each sharded tensor and, on rank
    0, every replicated one."""
    rows: dict[str, torch.Tensor] = {}
    layout: dict[str, list[int]] = {}
    shapes: dict[str, list[int]] = {}
    for key, tensor in tensors.items():
        local, start, shape = local_rows(tensor, ranks)
        sharded = local is not tensor
        if not sharded and ranks.rank != 0:
            continue
        rows[key] = local.detach().to("cpu").contiguous()
        layout[key] = [start]
        shapes[key] = list(shape)
    name = shard_name(ranks.rank, ranks.world)
    path = stage / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(rows, str(path), metadata={"layout": json.dumps(layout),
                                         "shapes": json.dumps(shapes)})
    return ShardWritten(name, path.stat().st_size, file_sha256(path), shapes)


class RowSource:
    """Rows of the tensors of a checkpoint, sharded (``shards/``) or whole
    (``policy.safetensors``), in a local directory (``rlvla3.checkpoint.files.row_source`` makes
    one). ``optimizer``: a whole checkpoint's optimizer state in ``Optimizer.state_dict``'s
    layout, where it is to be restored (None: none; a sharded checkpoint's is in its
    shards)."""

    def __init__(self, local: Path, optimizer: dict[str, Any] | None = None):
        self.local = Path(local)
        meta = json.loads((self.local / "meta.json").read_text())
        self.sharded = meta.get("format") == FORMAT
        self.param_groups = meta.get("optimizer", {}).get("param_groups")
        self._pieces: dict[str, list[tuple[Path, int, int]]] = {}
        """Key -> (file, first row, rows) of every piece holding some of it."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        if self.sharded:
            for name in sorted(n for n in meta["files"] if n.startswith(f"{SHARDS}/")):
                path = self.local / name
                with safe_open(str(path), "pt") as f:
                    header = f.metadata()
                    layout = json.loads(header["layout"])
                    shapes = json.loads(header["shapes"])
                    for key, (start,) in layout.items():
                        rows = f.get_slice(key).get_shape()
                        self._pieces.setdefault(key, []).append(
                            (path, start, rows[0] if rows else 0))
                        self.shapes[key] = tuple(shapes[key])
        else:
            self._whole = self._whole_tensors(meta.get("files") or {})
            self.shapes = {k: tuple(v.shape) for k, v in self._whole.items()}
        self._optimizer_by_index = None if self.sharded else optimizer
        if self._optimizer_by_index is not None:
            self.param_groups = [{k: v for k, v in g.items() if k != "params"}
                                 for g in self._optimizer_by_index["param_groups"]]

    def _whole_tensors(self, listed: Mapping[str, object]) -> dict[str, torch.Tensor]:
        """A whole checkpoint's weights (``model/``) and its proximal copy where ``listed``
        (``shadow/``)."""
        from safetensors.torch import load_file

        out = {f"model/{k}": v for k, v in load_file(str(self.local / "policy.safetensors"))
               .items()}
        if SHADOW_FILE in listed:
            out.update({f"{SHADOW}/{k}": v for k, v in
                        load_file(str(self.local / SHADOW_FILE)).items()})
        return out

    def bind_optimizer(self, names_in_order: list[str]) -> None:
        """A whole checkpoint's optimizer state (``optim/``), where one was given, under
        parameter names (``names_in_order``: the parameters of the optimizer's groups, in
        order, as it indexes them)."""
        state = self._optimizer_by_index
        if state is None:
            return
        for index, values in state["state"].items():
            for key, value in values.items():
                self._whole[f"optim/{names_in_order[int(index)]}/{key}"] = value
                self.shapes[f"optim/{names_in_order[int(index)]}/{key}"] = tuple(value.shape)

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.shapes if k.startswith(prefix))

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``key`` (the whole tensor for a 0-d one)."""
        if key not in self.shapes:
            raise KeyError(key)
        if not self.sharded:
            whole = self._whole[key]
            return whole if whole.dim() == 0 else whole[start:end]
        shape = self.shapes[key]
        if not shape:
            path, _, _ = self._pieces[key][0]
            with safe_open(str(path), "pt") as f:
                return f.get_tensor(key)
        parts = []
        for path, first, count in sorted(self._pieces[key], key=lambda p: p[1]):
            lo, hi = max(start, first), min(end, first + count)
            if lo < hi:
                with safe_open(str(path), "pt") as f:
                    parts.append(f.get_slice(key)[lo - first:hi - first])
        if not parts:
            return torch.empty((0, *shape[1:]))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        if out.shape[0] != end - start:
            raise ValueError(f"{self.local}: rows {start}:{end} of {key} are not all in the "
                             f"checkpoint (found {out.shape[0]})")
        return out

    def whole(self, key: str) -> torch.Tensor:
        shape = self.shapes[key]
        return self.rows(key, 0, shape[0] if shape else 0)


def stage_dir(scratch: Path) -> Path:
    path = scratch / "staging" / uuid.uuid4().hex
    path.mkdir(parents=True)
    return path


def cleanup(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)
