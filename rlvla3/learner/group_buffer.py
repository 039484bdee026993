"""A learner rank's decisions not yet trained, kept as whole queue items (numpy, no Ray).

Role: what a learner holds between its queue pulls and its optimizer steps. Input: ``Samples``
of one queue item each (one episode, or one whole GRPO group, advantages already computed).
Output: rows in arrival order, ``take(n)`` at a time (a micro-batch may span items, an item may
span optimizer steps), and the items that staleness discards.

Invariants:
- Rows leave in arrival order, none twice; ``size`` is the number of rows held.
- Staleness is judged per item, by its oldest decision, and an item is kept or discarded whole:
  ``discard_stale(bound, version)`` drops every item none of whose rows was taken yet and that
  ``bound`` (``rlvla3.queue.pacing.StalenessBound``, the rule the queue applies too) calls stale at
  learner version ``version``. An item whose first rows went into a micro-batch
  is finished, whatever its age: its rest goes into the next optimizer step (or the one after,
  for an item longer than a step). A per-decision floor would split a GRPO group: successful
  episodes end early, so their decisions are a group's oldest, and the floor would take the
  successes first and leave a zero-sum group whose every sampled action is pushed down.
- ``put_back`` returns the rows of an abandoned optimizer step to the front, in their order;
  they count as started (never discarded for staleness afterwards).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from rlvla3.learner.samples import Samples
from rlvla3.queue.pacing import StalenessBound


@dataclass
class _Item:
    samples: Samples
    oldest: int
    """Policy version of the item's oldest decision."""
    started: bool = False
    """Some of its rows have been taken: it is trained to the end, never discarded."""
    offset: int = 0
    """Rows before this one have been taken: the item keeps the arrays it arrived in, and a
    take copies only the rows it returns (cutting the remainder off each time would copy it
    again at every micro-batch: quadratic in the item's length, images included)."""

    @property
    def left(self) -> int:
        return len(self.samples) - self.offset

    def rows(self, n: int) -> Samples:
        """The next ``n`` rows (a copy of those rows alone)."""
        if self.offset == 0 and n == len(self.samples):
            return self.samples
        return self.samples.select(np.arange(self.offset, self.offset + n))


class GroupBuffer:
    """FIFO of queue items (see the module docstring)."""

    def __init__(self):
        self._items: deque[_Item] = deque()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, samples: Samples) -> None:
        """Append one queue item's samples."""
        if len(samples):
            self._items.append(_Item(samples, int(samples.policy_versions.min())))
            self.size += len(samples)

    def take(self, n: int) -> Samples:
        """The next ``n`` rows (``n <= size``), splitting the last item they reach."""
        parts, need = [], n
        while need > 0:
            head = self._items[0]
            count = min(need, head.left)
            parts.append(head.rows(count))
            head.offset += count
            head.started = True
            need -= count
            if head.left == 0:
                self._items.popleft()
        self.size -= n
        return parts[0] if len(parts) == 1 else Samples.concat(parts)

    def peek(self, n: int) -> Samples:
        """The next ``n`` rows (``n <= size``) without taking them."""
        parts, need = [], n
        for item in self._items:
            parts.append(item.rows(min(need, item.left)))
            need -= len(parts[-1])
            if need <= 0:
                break
        return parts[0] if len(parts) == 1 else Samples.concat(parts)

    def peek_advantages(self, n: int) -> np.ndarray:
        """Advantages of the next ``n`` rows (``n <= size``)."""
        out, need = [], n
        for item in self._items:
            out.append(item.samples.advantages[item.offset:item.offset + need])
            need -= len(out[-1])
            if need <= 0:
                break
        return np.concatenate(out)

    def discard_stale(self, bound: StalenessBound, version: int) -> list[Samples]:
        """Drop the unstarted items that ``bound`` calls stale at learner version ``version``;
        returns them (for counting)."""
        kept: deque[_Item] = deque()
        dropped = []
        for item in self._items:
            if not item.started and bound.stale(item.oldest, version):
                dropped.append(item.samples)
                self.size -= len(item.samples)
            else:
                kept.append(item)
        self._items = kept
        return dropped

    def put_back(self, parts: list[Samples]) -> None:
        """Return rows taken for an abandoned step to the front, in their order."""
        for part in reversed(parts):
            self._items.appendleft(_Item(part, int(part.policy_versions.min()), started=True))
            self.size += len(part)
