"""Dynamic batching of concurrent requests (pure asyncio, no Ray), used by the rollout server.

Role: many env slots ask for actions independently; the batcher groups whatever requests are
pending into one call of ``process`` so the policy runs on a batch. Input: items submitted with
``await batcher.submit(item)`` from any number of coroutines of one event loop. Output: each
caller gets the result that ``process`` returned for its item.

Firing rule: a batch fires as soon as ``b_max`` requests are pending, or when ``t_max`` has
passed since the first pending request (its submission time), whichever comes first. Requests
that piled up while the previous batch ran are therefore served without further waiting once
their deadline has passed. The limits come from a batching rule
(``rlvla3.rollout.batching``: fixed, or adaptive from the measured costs and arrival rate), asked
only while a batch is forming: no timer runs before the first request of a batch.

Invariants:
- A batch never holds more than ``b_max`` items; batches run one at a time, in arrival order.
- ``between_batches`` runs before each batch and never while one runs, so weights swapped there
  are the same for every item of a batch.
- ``process(items)`` returns one result per item, in order; if it raises (or returns the wrong
  number of results) every caller of that batch gets the exception, and no other caller does;
  the loop keeps serving.
- A synchronous ``process`` runs in a worker thread, so requests keep arriving (and their
  timestamps stay true) while the policy computes.
- After ``close()`` every unresolved caller gets ``BatcherClosed``; nothing hangs.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rlvla3.rollout.batching import BatchingRule

ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request was served."""


@dataclass(frozen=True)
class BatcherStats:
    """What the batcher did since it started (or since the last ``stats(reset=True)``)."""

    batches: int
    items: int
    batch_sizes: dict[int, int] = field(default_factory=dict)
    """Histogram: batch size -> number of batches of that size."""
    mean_batch_size: float = 0.0
    mean_wait_s: float = 0.0
    """Mean time from a batch's first request to the moment the batch fired."""
    busy_fraction: float = 0.0
    """Fraction of wall time spent in ``between_batches`` and ``process``."""
    mean_service_s: float = 0.0
    """Mean time ``process`` took per batch."""
    rule: dict[str, float] = field(default_factory=dict)
    """The batching rule's current figures (``b_max``, ``t_max_ms``, fitted costs, ...)."""


@dataclass
class _Request:
    item: Any
    future: asyncio.Future
    submitted: float


class DynamicBatcher(Generic[ItemT, ResultT]):
    """Batches concurrent ``submit`` calls into ``process`` calls (see the module docstring)."""

    def __init__(
        self,
        process: Callable[[list[ItemT]], Sequence[ResultT] | Awaitable[Sequence[ResultT]]],
        rule: BatchingRule,
        between_batches: Callable[[], Awaitable[None]] | None = None,
    ):
        self._process = process
        self.rule = rule
        self._b_max = 1
        self._between_batches = between_batches
        self._pending: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._reset_stats()

    def _reset_stats(self) -> None:
        self._since = time.monotonic()
        self._sizes: Counter[int] = Counter()
        self._wait_total = 0.0
        self._busy_total = 0.0
        self._service_total = 0.0

    async def submit(self, item: ItemT) -> ResultT:
        """Queue ``item`` and wait for its result (or the exception of its batch)."""
        if self._closed:
            raise BatcherClosed("the batcher is closed")
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._reset_stats()
            self._task = loop.create_task(self._serve())
        request = _Request(item, loop.create_future(), time.monotonic())
        self.rule.arrived(request.submitted)
        self._pending.append(request)
        self._wake.set()
        return await request.future

    async def _serve(self) -> None:
        while True:
            await self._wait_for_batch()
            fired = time.monotonic()
            self._running = self._take_batch()
            if not self._running:
                continue
            self._wait_total += fired - self._running[0].submitted
            self._sizes[len(self._running)] += 1
            try:
                if self._between_batches is not None:
                    await self._between_batches()
                started = time.monotonic()
                results = await self._call_process([r.item for r in self._running])
                service = time.monotonic() - started
                self._service_total += service
                self.rule.served(len(self._running), service)
                if len(results) != len(self._running):
                    raise RuntimeError(
                        f"process returned {len(results)} results for {len(self._running)} items"
                    )
                for request, result in zip(self._running, results, strict=True):
                    if not request.future.done():
                        request.future.set_result(result)
            except Exception as exc:  # delivered to the callers of this batch only
                for request in self._running:
                    if not request.future.done():
                        request.future.set_exception(exc)
            # On cancellation (close) the batch stays in self._running for close() to fail.
            self._running = []
            self._busy_total += time.monotonic() - fired

    async def _wait_for_batch(self) -> None:
        """Return once ``fire_at`` requests are pending or the first one's deadline has passed
        (both asked of the rule now that a first request is pending, and again as more
        arrive); the batch then takes up to the rule's ``b_max``."""
        while not self._pending:
            self._wake.clear()
            await self._wake.wait()
        while True:
            limits = self.rule.limits(len(self._pending), time.monotonic())
            self._b_max = limits.b_max
            if len(self._pending) >= limits.fire_at:
                return
            remaining = self._pending[0].submitted + limits.t_max_s - time.monotonic()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _take_batch(self) -> list[_Request]:
        batch: list[_Request] = []
        while self._pending and len(batch) < self._b_max:
            request = self._pending.popleft()
            if not request.future.done():  # a caller that was cancelled while waiting
                batch.append(request)
        return batch

    async def _call_process(self, items: list[ItemT]) -> Sequence[ResultT]:
        if inspect.iscoroutinefunction(self._process):
            return await self._process(items)
        results = await asyncio.to_thread(self._process, items)
        if inspect.isawaitable(results):
            results = await results
        return results

    def stats(self, reset: bool = False) -> BatcherStats:
        """Counters since the start (or the last reset); ``reset`` starts a new window."""
        batches = sum(self._sizes.values())
        items = sum(size * count for size, count in self._sizes.items())
        elapsed = max(time.monotonic() - self._since, 1e-9)
        out = BatcherStats(
            batches=batches,
            items=items,
            batch_sizes=dict(sorted(self._sizes.items())),
            mean_batch_size=items / batches if batches else 0.0,
            mean_wait_s=self._wait_total / batches if batches else 0.0,
            busy_fraction=min(self._busy_total / elapsed, 1.0),
            mean_service_s=self._service_total / batches if batches else 0.0,
            rule=self.rule.state(),
        )
        if reset:
            self._reset_stats()
        return out

    @property
    def pending(self) -> int:
        """Requests waiting for a batch (not counting the batch that is running)."""
        return len(self._pending)

    async def close(self) -> None:
        """Stop serving; every unresolved caller (pending or running) gets ``BatcherClosed``."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        error = BatcherClosed("the batcher was closed before this request was served")
        for request in [*self._running, *self._pending]:
            if not request.future.done():
                request.future.set_exception(error)
        self._pending.clear()
        self._running = []
