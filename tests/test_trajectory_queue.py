"""Ray-free tests of the trajectory queue: backpressure, the staleness filter, GRPO groups
(released whole, expired, skipped when uniform) and pacing (admission against the learners'
lag and backlog)."""

from __future__ import annotations

import asyncio

import pytest

from rlvla3.run_config import load_run_config
from rlvla3.types import EpisodeKey


def _info(min_version: int, key: EpisodeKey | None = None, decisions: int = 3,
          max_version: int = -1):
    from actors.trajectory_queue import SegmentInfo

    return SegmentInfo("w0/s0", key or EpisodeKey(0, 0), decisions, 2 * decisions, min_version,
                       1.0, True, max_version)


def _queue(**kw):
    from actors.trajectory_queue import TrajectoryQueue
    from rlvla3.run_config import QueueConfig

    group_size = kw.pop("group_size", 1)
    batch = kw.pop("global_batch", 1)
    initial = kw.pop("initial_decisions", 1.0)
    skip_uniform = kw.pop("skip_uniform", False)
    return TrajectoryQueue(QueueConfig(**kw), group_size, batch, initial, skip_uniform)


def _refs(items) -> list:
    return [[refs[0] for _, refs in item] for item in items]


def test_queue_staleness_filter_and_backpressure():
    async def scenario():
        queue = _queue(capacity=3, max_staleness=2)
        await queue.put(_info(0), ["ref0"])
        await queue.put(_info(0, max_version=2), ["ref0-2"])  # its newest decision is fresh
        await queue.put(_info(3), ["ref3"])
        blocked = asyncio.create_task(queue.put(_info(4), ["ref4"]))
        await asyncio.sleep(0.05)
        assert not blocked.done(), "a full queue must make put wait (backpressure)"
        await queue.set_version(4)
        got = await queue.get(max_items=2, timeout_s=1.0)
        await asyncio.wait_for(blocked, 1.0)
        rest = await queue.get(max_items=10, timeout_s=1.0)
        empty = await queue.get(max_items=10, timeout_s=0.05)
        return got, rest, empty, queue.stats()

    got, rest, empty, stats = asyncio.run(scenario())
    # version 0 alone is more than 2 behind 4: dropped; 0..2 still holds fresh decisions
    assert _refs(got) == [["ref0-2"], ["ref3"]]
    assert _refs(rest) == [["ref4"]]
    assert empty == []
    assert stats["dropped_stale"] == 1 and stats["dropped_stale_decisions"] == 3
    assert stats["got"] == 3 and stats["put_decisions"] == 12
    assert stats["put_decisions"] == (stats["got_decisions"] + stats["queued_decisions"]
                                      + stats["dropped_stale_decisions"])


def test_queue_follows_a_restored_learner_backwards():
    async def scenario():
        queue = _queue(capacity=8, max_staleness=2)
        await queue.set_version(20)
        await queue.set_version(12)  # an out-of-date report does not move it back
        assert queue.stats()["version"] == 20
        await queue.set_version(12, restored=True)
        await queue.put(_info(12), ["fresh after the rollback"])
        return await queue.get(max_items=4, timeout_s=1.0), queue.stats()

    got, stats = asyncio.run(scenario())
    assert _refs(got) == [["fresh after the rollback"]] and stats["dropped_stale"] == 0


def test_grpo_groups_are_released_whole_and_short_groups_complete():
    """Members of a group arrive interleaved with other groups; a group leaves the queue as
    one item once whole; a member lost to a fault shortens its group instead of blocking it."""
    a, b, c = EpisodeKey(0, 0), EpisodeKey(1, 2), EpisodeKey(2, 1)

    async def scenario():
        queue = _queue(capacity=8, max_staleness=4, group_size=3)
        await queue.put(_info(0, a), ["a0"])
        await queue.put(_info(0, b), ["b0"])
        await queue.put(_info(0, a), ["a1"])
        assert queue.depth() == 0 and queue.stats()["held_episodes"] == 3
        await queue.put(_info(0, a), ["a2"])
        first = await queue.get(max_items=8, timeout_s=1.0)
        await queue.drop(b, decisions=5)  # one of b's members will never arrive
        await queue.put(_info(0, b), ["b1"])
        second = await queue.get(max_items=8, timeout_s=1.0)
        await queue.drop(c, decisions=2)  # a fault before any member of c shipped
        await queue.put(_info(1, c), ["c0"])
        await queue.put(_info(1, c), ["c1"])
        third = await queue.get(max_items=8, timeout_s=1.0)
        return first, second, third, queue.stats()

    first, second, third, stats = asyncio.run(scenario())
    assert _refs(first) == [["a0", "a1", "a2"]]
    assert _refs(second) == [["b0", "b1"]]
    assert _refs(third) == [["c0", "c1"]]
    assert stats["held_episodes"] == 0 and stats["expired"] == 0


def test_grpo_held_groups_expire_by_staleness():
    k = EpisodeKey(3, 3)

    async def scenario():
        queue = _queue(capacity=8, max_staleness=2, group_size=4)
        await queue.put(_info(0, k, decisions=7), ["k0"])
        await queue.put(_info(1, k, decisions=5), ["k1"])
        await queue.set_version(3)
        held = queue.stats()["held_episodes"]
        await queue.set_version(4)  # newest member (v1) is now 3 > 2 versions behind
        return held, queue.stats()

    held, stats = asyncio.run(scenario())
    assert held == 2
    assert stats["held_episodes"] == 0 and stats["expired_groups"] == 1
    assert stats["expired"] == 2 and stats["expired_decisions"] == 12
    assert stats["put_decisions"] == stats["expired_decisions"]


def test_grpo_uniform_groups_are_skipped_and_counted_when_asked():
    """A group whose members all have the same return (all failed, or all succeeded) carries no
    advantage: with ``skip_uniform`` it is counted and never queued; a mixed group, and any
    group without the option, is queued whole. Short groups (a member lost) are judged on the
    members they have."""
    from actors.trajectory_queue import SegmentInfo

    def info(key, ret, decisions=4):
        return SegmentInfo("w0/s0", key, decisions, 2 * decisions, 0, ret, ret > 0.5)

    async def scenario(skip):
        queue = _queue(capacity=8, max_staleness=4, group_size=3, skip_uniform=skip)
        fail, win, mixed, short = (EpisodeKey(t, 0) for t in range(4))
        for key, returns in ((fail, (0.0, 0.0, 0.0)), (win, (1.0, 1.0, 1.0)),
                             (mixed, (0.0, 1.0, 0.0)), (short, (1.0, 1.0))):
            for i, ret in enumerate(returns):
                await queue.put(info(key, ret, decisions=4 + i), [f"{key.task_id}/{i}"])
        await queue.drop(short, decisions=2)
        got = await queue.get(max_items=8, timeout_s=1.0)
        return [item[0][1][0].split("/")[0] for item in got], queue.stats()

    kept, stats = asyncio.run(scenario(skip=True))
    assert kept == ["2"]  # only the mixed group
    assert (stats["uniform_groups"], stats["uniform"], stats["uniform_decisions"]) == (3, 8, 39)  # 15 + 15 + 9
    assert stats["put_decisions"] == (stats["got_decisions"] + stats["queued_decisions"]
                                      + stats["held_decisions"] + stats["uniform_decisions"])
    kept, stats = asyncio.run(scenario(skip=False))
    assert kept == ["0", "1", "2", "3"] and stats["uniform_groups"] == 0


def test_inherent_lag_counts_the_episodes_a_slot_runs_for_one_grpo_group():
    # the multi-task LIBERO run: 2 workers x 2 slots, 44 decisions, global batch 32
    base = ["env_workers.num_workers=2", "env_workers.slots_per_worker=2",
            "learner.global_batch=32"]
    ppo = load_run_config("smoke", overrides=base + ["algo.name=ppo"])
    grpo = load_run_config("smoke", overrides=base + ["algo.name=grpo", "algo.group_size=4"])
    odd = load_run_config("smoke", overrides=base + ["algo.name=grpo", "algo.group_size=3"])
    assert (ppo.group_rounds(), grpo.group_rounds(), odd.group_rounds()) == (1, 2, 2)
    assert ppo.inherent_lag(44) == pytest.approx(5.5)
    assert grpo.inherent_lag(44) == pytest.approx(11.0)  # a group's first episode waits twice


def test_pacing_holds_new_episodes_until_the_learners_catch_up():
    """With the learner busy, admission waits instead of letting data age (no discards); it
    resumes as the learner reports what it consumed; a starving learner is never held back."""
    async def scenario():
        # batch 10 decisions, pace target 2 versions, episodes of 5 decisions expected
        queue = _queue(capacity=100, max_staleness=4, pace_lag=2.0, global_batch=10,
                       initial_decisions=5.0)
        await queue.learner_buffered(0, 10)  # the learner holds a whole batch
        t1 = await queue.admit(0, EpisodeKey(0, 0))  # none in flight: always admitted
        t2 = await queue.admit(0, EpisodeKey(0, 0))  # (10 + 2 * 5) / 10 = 2 <= 2
        third = asyncio.create_task(queue.admit(1, EpisodeKey(0, 0)))  # (10 + 15) / 10 > 2
        await asyncio.sleep(0.05)
        assert not third.done()
        await queue.put(_info(0, decisions=5), ["x"], t1)  # (10 + 5 + 2 * 5) / 10 = 2.5
        await asyncio.sleep(0.05)
        assert not third.done()
        await queue.learner_buffered(0, 0)  # trained: (5 + 2 * 5) / 10 = 1.5
        t3 = await asyncio.wait_for(third, 1.0)
        assert queue.stats()["in_flight_episodes"] == 2
        lost = await queue.reset_worker(1)  # worker 1 restarted: its admission died with it
        assert lost == 1 and queue.stats()["in_flight_episodes"] == 1
        # less than a batch of work ahead of the learner: admitted whatever the target says
        tight = _queue(capacity=100, max_staleness=0, pace_lag=0.1, global_batch=10,
                       initial_decisions=4.0)
        first = await tight.admit(0, EpisodeKey(0, 0))
        second = await asyncio.wait_for(tight.admit(0, EpisodeKey(0, 0)), 1.0)  # 4 < 10
        held = asyncio.create_task(tight.admit(0, EpisodeKey(0, 0)))  # 8 + ... : lag 0.8 < 1
        third = await asyncio.wait_for(held, 1.0)
        fourth = asyncio.create_task(tight.admit(0, EpisodeKey(0, 0)))  # 12 ahead: waits
        await asyncio.sleep(0.05)
        assert not fourth.done()
        await tight.close()
        await asyncio.wait_for(fourth, 1.0)  # a closing queue releases every waiting slot
        return queue.stats(), (t2, t3, first, second, third)

    stats, _ = asyncio.run(scenario())
    assert stats["admitted"] == 3 and stats["dropped_stale"] == 0


def test_pacing_backlog_bound_is_at_least_one_grpo_group():
    """A GRPO group arrives whole: with groups larger than ``pace_backlog`` global batches, a
    backlog of one group still admits slots (the lag target permitting), and only more than a
    group holds them back."""
    async def scenario(group_size: int, buffered: int) -> bool:
        # batch 10, groups of 4 episodes of 10 decisions: one group is 40 > 2 batches
        queue = _queue(capacity=100, max_staleness=12, pace_lag=9.0, pace_backlog=2.0,
                       global_batch=10, initial_decisions=10.0, group_size=group_size)
        await queue.learner_buffered(0, buffered)
        await queue.admit(0, EpisodeKey(0, 0))  # none in flight: always admitted
        second = asyncio.create_task(queue.admit(1, EpisodeKey(0, 0)))  # lag (40+20)/10 = 6
        await asyncio.sleep(0.05)
        admitted = second.done()
        await queue.close()
        await asyncio.wait_for(second, 1.0)
        return admitted

    assert asyncio.run(scenario(group_size=4, buffered=40))  # one group: admitted
    assert not asyncio.run(scenario(group_size=4, buffered=50))  # more than a group: held
    assert not asyncio.run(scenario(group_size=1, buffered=40))  # single episodes: 2 batches


def test_pace_lag_zero_never_holds_a_slot_back():
    """``queue.pace_lag=0`` turns pacing off: with no learner consuming and a backlog far
    beyond ``pace_backlog`` batches, every slot is still admitted at once (what the env-alone
    stage of ``bench async`` relies on)."""
    async def scenario():
        queue = _queue(capacity=1000, max_staleness=4, pace_lag=0, global_batch=10,
                       initial_decisions=5.0)
        await queue.learner_buffered(0, 500)
        tickets = [await asyncio.wait_for(queue.admit(w, EpisodeKey(0, 0)), 1.0)
                   for w in range(20)]
        paced = _queue(capacity=1000, max_staleness=4, pace_lag=3.0, global_batch=10,
                       initial_decisions=5.0)
        await paced.learner_buffered(0, 500)
        await paced.admit(0, EpisodeKey(0, 0))  # none in flight: always admitted
        waiting = asyncio.create_task(paced.admit(1, EpisodeKey(0, 0)))
        await asyncio.sleep(0.05)
        held = not waiting.done()
        await paced.close()
        await asyncio.wait_for(waiting, 1.0)
        return tickets, queue.stats(), held

    tickets, stats, held = asyncio.run(scenario())
    assert len(set(tickets)) == 20 and stats["in_flight_episodes"] == 20
    assert held  # the same backlog holds a paced slot back
