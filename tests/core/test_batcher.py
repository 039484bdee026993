"""DynamicBatcher: the B_max / T_max firing rule, routing, isolation of failures, the
between-batches hook and shutdown. Plain asyncio (``asyncio.run`` inside each test)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from rlvla3.config import ConfigError, Named, build
from rlvla3.rollout.batcher import BatcherClosed, DynamicBatcher
from rlvla3.rollout.batching import FixedBatching
from rlvla3.run_config import RolloutConfig


class Recorder:
    """An async ``process`` that records each batch and answers ``item * 10``."""

    def __init__(self, delay_s: float = 0.0):
        self.batches: list[list[int]] = []
        self.delay_s = delay_s

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        await asyncio.sleep(self.delay_s)
        return [i * 10 for i in items]


def test_fires_at_b_max_without_waiting_for_t_max():
    async def main():
        process = Recorder()
        batcher = DynamicBatcher(process, FixedBatching(8, 5.0))
        start = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(8)))
        elapsed = time.monotonic() - start
        await batcher.close()
        return process, results, elapsed, batcher.stats()

    process, results, elapsed, stats = asyncio.run(main())
    assert results == [i * 10 for i in range(8)]
    assert process.batches == [list(range(8))]
    assert elapsed < 1.0  # far below t_max = 5 s
    assert stats.batch_sizes == {8: 1} and stats.items == 8


def test_fires_at_t_max_with_fewer_than_b_max():
    async def main():
        process = Recorder()
        batcher = DynamicBatcher(process, FixedBatching(64, 0.1))
        start = time.monotonic()
        results = await asyncio.gather(*(batcher.submit(i) for i in range(3)))
        elapsed = time.monotonic() - start
        await batcher.close()
        return process, results, elapsed, batcher.stats()

    process, results, elapsed, stats = asyncio.run(main())
    assert results == [0, 10, 20]
    assert process.batches == [[0, 1, 2]]
    assert 0.09 <= elapsed < 1.0  # loose upper bound: the machine is shared and noisy
    assert 0.09 <= stats.mean_wait_s < 1.0
    assert stats.mean_batch_size == 3.0


def test_t_max_counts_from_the_first_pending_request():
    async def main():
        process = Recorder()
        batcher = DynamicBatcher(process, FixedBatching(64, 1.0))
        start = time.monotonic()
        first = asyncio.ensure_future(batcher.submit(0))
        await asyncio.sleep(0.7)
        # a late request must not extend the deadline of the first one
        second = await batcher.submit(1)
        elapsed = time.monotonic() - start
        await batcher.close()
        return process, await first, second, elapsed

    process, first, second, elapsed = asyncio.run(main())
    assert (first, second) == (0, 10)
    assert process.batches == [[0, 1]]
    # ~1.0 s, not 0.7 + 1.0 s: the margin either side takes a loaded machine's delays
    assert 0.99 <= elapsed < 1.6


def test_never_exceeds_b_max_and_routes_results_under_a_burst():
    async def main():
        process = Recorder(delay_s=0.002)
        batcher = DynamicBatcher(process, FixedBatching(5, 0.002))
        rng = random.Random(0)

        async def caller(i: int) -> tuple[int, int]:
            await asyncio.sleep(rng.random() * 0.02)
            return i, await batcher.submit(i)

        answers = await asyncio.gather(*(caller(i) for i in range(203)))
        await batcher.close()
        return process, answers, batcher.stats()

    process, answers, stats = asyncio.run(main())
    assert all(result == i * 10 for i, result in answers)
    assert max(len(b) for b in process.batches) <= 5
    assert sorted(i for b in process.batches for i in b) == list(range(203))
    assert stats.items == 203 and max(stats.batch_sizes) <= 5
    assert sum(stats.batch_sizes.values()) == len(process.batches) == stats.batches
    assert 0.0 < stats.busy_fraction <= 1.0


def test_an_exception_reaches_only_the_callers_of_its_batch():
    async def process(items: list[int]) -> list[int]:
        if any(i < 0 for i in items):
            raise ValueError(f"bad batch {items}")
        return [i + 1 for i in items]

    async def main():
        batcher = DynamicBatcher(process, FixedBatching(2, 0.05))
        first = await asyncio.gather(
            *(batcher.submit(i) for i in (-1, 1, 2, 3)), return_exceptions=True
        )
        later = await asyncio.gather(batcher.submit(7), batcher.submit(8))  # still serving
        await batcher.close()
        return first, later

    first, later = asyncio.run(main())
    assert isinstance(first[0], ValueError) and isinstance(first[1], ValueError)
    assert first[0] is first[1]
    assert first[2:] == [3, 4]
    assert later == [8, 9]


def test_wrong_number_of_results_is_an_error_for_that_batch():
    async def main():
        batcher = DynamicBatcher(lambda items: items[:-1], FixedBatching(2, 0.01))
        out = await asyncio.gather(batcher.submit(1), batcher.submit(2), return_exceptions=True)
        await batcher.close()
        return out

    out = asyncio.run(main())
    assert all(isinstance(o, RuntimeError) and "1 results for 2 items" in str(o) for o in out)


def test_sync_process_runs_off_the_event_loop():
    def process(items: list[int]) -> list[int]:
        time.sleep(0.05)  # a blocking forward pass
        return [-i for i in items]

    async def main():
        batcher = DynamicBatcher(process, FixedBatching(4, 0.001))
        busy = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.01)  # the batch [1] is now running in a thread
        ticks = 0
        while not busy.done():  # the loop stays responsive meanwhile
            ticks += 1
            await asyncio.sleep(0.005)
        rest = await asyncio.gather(*(batcher.submit(i) for i in range(2, 6)))
        await batcher.close()
        return await busy, rest, ticks

    first, rest, ticks = asyncio.run(main())
    assert first == -1 and rest == [-2, -3, -4, -5]
    assert ticks >= 3


def test_between_batches_hook_never_runs_during_a_batch():
    async def main():
        state = {"version": 0, "in_batch": False, "hook_calls": 0}
        seen: list[set[int]] = []

        async def hook() -> None:
            assert not state["in_batch"]
            await asyncio.sleep(0.001)
            state["version"] += 1
            state["hook_calls"] += 1

        async def process(items: list[int]) -> list[int]:
            state["in_batch"] = True
            versions = set()
            for _ in items:  # yield repeatedly: the hook must still not run
                versions.add(state["version"])
                await asyncio.sleep(0)
            versions.add(state["version"])
            seen.append(versions)
            state["in_batch"] = False
            return [state["version"]] * len(items)

        batcher = DynamicBatcher(process, FixedBatching(4, 0.001), hook)
        rng = random.Random(1)

        async def caller(i: int) -> int:
            await asyncio.sleep(rng.random() * 0.03)
            return await batcher.submit(i)

        results = await asyncio.gather(*(caller(i) for i in range(60)))
        await batcher.close()
        return state, seen, results

    state, seen, results = asyncio.run(main())
    assert all(len(versions) == 1 for versions in seen)  # one version per batch
    assert state["hook_calls"] == len(seen)  # once before each batch
    assert sorted({v for versions in seen for v in versions}) == list(range(1, len(seen) + 1))
    assert set(results) <= {v for versions in seen for v in versions}


def test_close_with_pending_and_running_requests_does_not_hang():
    async def main():
        process = Recorder(delay_s=30.0)  # a batch that would run for a long time
        batcher = DynamicBatcher(process, FixedBatching(2, 60.0))
        running = [asyncio.ensure_future(batcher.submit(i)) for i in range(2)]
        await asyncio.sleep(0.05)  # [0, 1] fired (b_max) and is running
        pending = asyncio.ensure_future(batcher.submit(2))  # waits for t_max = 60 s
        await asyncio.sleep(0.01)
        assert batcher.pending == 1
        await asyncio.wait_for(batcher.close(), timeout=2.0)
        out = await asyncio.wait_for(
            asyncio.gather(*running, pending, return_exceptions=True), timeout=2.0
        )
        with pytest.raises(BatcherClosed):
            await batcher.submit(3)
        return process, out

    process, out = asyncio.run(main())
    assert process.batches == [[0, 1]]
    assert all(isinstance(o, BatcherClosed) for o in out)


def test_close_before_any_request():
    async def main():
        batcher = DynamicBatcher(Recorder(), FixedBatching(64, 0.005))
        await batcher.close()
        return batcher.stats()

    assert asyncio.run(main()).batches == 0


def _fixed(**options):
    return {"batching": {"name": "fixed", "options": options}}


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (_fixed(b_max=0), "rollout.batching.options.b_max"),
        (_fixed(t_max_ms=-1.0), "rollout.batching.options.t_max_ms"),
        (_fixed(b_max=2.5), "rollout.batching.options.b_max"),
        (_fixed(t_max=5), "rollout.batching.options.t_max"),
        ({"b_max": 4}, "rollout.b_max"),  # the old spelling: only load_run_config upgrades it
    ],
)
def test_config_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as info:
        build(RolloutConfig, data, "rollout")
    assert info.value.field == field


def test_config_accepts_zero_t_max():
    cfg = build(RolloutConfig, _fixed(b_max=1, t_max_ms=0), "rollout")
    assert cfg.batching.options == {"b_max": 1, "t_max_ms": 0} and cfg.largest_batch == 1
    assert build(RolloutConfig, {}, "rollout").largest_batch == 64  # fixed, its defaults
    adaptive = build(RolloutConfig, {"batching": {"name": "adaptive",
                                                  "options": {"b_limit": 96}}}, "rollout")
    assert adaptive.largest_batch == 96


def test_the_old_spelling_of_the_fixed_rules_options_is_moved_with_one_line(capsys):
    from rlvla3.run_config import load_run_config

    cfg = load_run_config("default", overrides=["rollout.b_max=3"])
    assert cfg.rollout.batching == Named("fixed", {"b_max": 3, "t_max_ms": 2.0})  # preset's t
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'rollout.b_max' is spelled 'rollout.batching.options.b_max'" \
        in err[0] and "deprecated" in err[0]
    # both, in a user's file: moved together, the old spelling over the preset's new one
    cfg = load_run_config("default", overrides=["rollout.t_max_ms=0", "rollout.b_max=5"])
    assert cfg.rollout.batching.options == {"b_max": 5, "t_max_ms": 0}
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # under adaptive batching they were never read: dropped, and the line says so
    cfg = load_run_config("default", overrides=["rollout.batching=adaptive", "rollout.b_max=9"])
    assert cfg.rollout.batching == Named("adaptive", {}) and cfg.rollout.largest_batch == 256
    err = capsys.readouterr().err
    assert "'rollout.b_max' ignored: adaptive batching does not read it" in err
    load_run_config("default")
    assert capsys.readouterr().err == ""  # the presets use the new spelling


def test_a_fixed_policy_built_in_code_refuses_what_the_config_refuses():
    with pytest.raises(ConfigError, match="b_max"):
        FixedBatching(0, 0.005)
    with pytest.raises(ConfigError, match="t_max_ms"):
        FixedBatching(4, -0.001)


def test_a_choice_given_another_name_does_not_keep_the_old_ones_options():
    from rlvla3.run_config import load_run_config

    for override in ("rollout.batching={name: adaptive, options: {b_limit: 64}}",
                     "rollout.batching.name=adaptive"):
        cfg = load_run_config("default", overrides=[override])  # the preset's is fixed's
        assert cfg.rollout.batching.name == "adaptive"
        assert "b_max" not in cfg.rollout.batching.options
    cfg = load_run_config("default", overrides=["rollout.batching.options.b_limit=32",
                                                "rollout.batching.name=adaptive"])
    assert cfg.rollout.batching == Named("adaptive", {"b_limit": 32})  # kept, given after
    cfg = load_run_config("default", overrides=["rollout.batching.options.b_max=16"])
    assert cfg.rollout.batching == Named("fixed", {"b_max": 16, "t_max_ms": 2.0})  # merged
    # a section that is more than a choice merges as before: algo keeps the preset's gamma
    assert load_run_config("default", overrides=["algo.name=grpo"]).algo.gamma == 0.95
