"""Ray-free tests of GRPO dynamic sampling (``algo.redraw_rounds``): the trajectory queue's core
holds a uniform group and hands its key out again to its env worker's next admissions, releases
the group whole once mixed, skips it (counted) when its rounds are spent, and leaks no ticket
when the worker is lost mid-round; the decision accounting adds up in every case."""

from __future__ import annotations

import pytest

from rlvla3.config import ConfigError
from rlvla3.episode.tasks import TaskSampler
from rlvla3.queue.core import QueueCore
from rlvla3.run_config import QueueConfig, load_run_config
from rlvla3.types import EpisodeKey, SegmentInfo

K, OTHER = EpisodeKey(3, 7), EpisodeKey(5, 1)


class NoMetrics:
    def inc(self, name: str, value: float = 1.0) -> None:
        pass

    def set(self, name: str, value: float) -> None:
        pass

    def observe(self, name: str, value: float) -> None:
        pass


def _core(rounds: int, group_size: int = 2, skip_uniform: bool = True, **queue) -> QueueCore:
    cfg = QueueConfig(**{"capacity": 64, "max_staleness": 8, **queue})
    return QueueCore(cfg, NoMetrics(), group_size, global_batch=8, initial_decisions=4.0,
                     skip_uniform=skip_uniform, redraw_rounds=rounds)


def _ship(core: QueueCore, ticket: int, ret: float, decisions: int = 4, version: int = 0,
          ref: str = "") -> None:
    """The episode of ``ticket`` ends with return ``ret`` and is put (as the queue actor does)."""
    info = SegmentInfo("w0/s0", core.ticket_key(ticket), decisions, 2 * decisions, version,
                       ret, ret > 0.5)
    core.put(info, [ref], 0.0, core.finished(info, ticket))


def _balanced(core: QueueCore) -> None:
    """The queue's decision invariant, with dynamic sampling's counts inside it."""
    s = core.stats()
    assert s.put_decisions == (s.queued_decisions + s.held_decisions + s.got_decisions
                               + s.dropped_stale_decisions + s.expired_decisions
                               + s.uniform_decisions), s
    assert s.redrawn_decisions <= s.put_decisions and s.redrawn <= s.put
    assert s.redraw_skipped_groups <= s.uniform_groups
    assert s.rescued_groups + s.redraw_skipped_groups <= s.redraws


def _uniform_group(core: QueueCore, worker: int = 0, incarnation: str = "w0",
                   key: EpisodeKey = K) -> list[int]:
    """A whole first round of ``key``: every member fails."""
    tickets = [core.admit(worker, incarnation, key, 0.0) for _ in range(core.group_size)]
    for t in tickets:
        _ship(core, t, 0.0, ref=f"first{t}")
    return tickets


def test_a_uniform_group_with_rounds_left_is_held_and_its_key_handed_out_again():
    core = _core(rounds=2)
    core.learner_buffered(0, 10_000)  # pacing would hold any new episode back
    core.admit(1, "w1", OTHER, 0.0)  # something in flight: pacing no longer admits for free
    _uniform_group(core)
    stats = core.stats()
    assert core.depth() == 0 and stats.uniform_groups == 0  # not skipped: held
    assert stats.held_episodes == 2 and stats.redraws == 1
    # the owner's next admissions run the held key whatever they asked, past the pacing
    assert core.may_admit(OTHER, "w0")
    redraw = core.admit(0, "w0", OTHER, 0.0)
    assert core.ticket_key(redraw) == K
    # another worker's admission is its own: not swapped, and paced as before
    assert not core.may_admit(EpisodeKey(9, 9), "w1")
    assert core.ticket_key(core.admit(1, "w1", OTHER, 0.0)) == OTHER
    assert core.ticket_key(core.admit(0, "w0", OTHER, 0.0)) == K  # the round's second member
    assert core.ticket_key(core.admit(0, "w0", OTHER, 0.0)) == OTHER  # round full: as asked
    _balanced(core)


def test_a_group_that_becomes_mixed_is_released_whole_with_all_its_members():
    core = _core(rounds=2)
    _uniform_group(core)
    round1 = [core.admit(0, "w0", OTHER, 0.0) for _ in range(2)]
    _ship(core, round1[0], 0.0, ref="r1a")  # still uniform after round 1: a second round
    _ship(core, round1[1], 0.0, ref="r1b")
    assert core.stats().redraws == 2 and core.depth() == 0
    round2 = [core.admit(0, "w0", OTHER, 0.0) for _ in range(2)]
    assert [core.ticket_key(t) for t in round2] == [K, K]
    _ship(core, round2[0], 1.0, ref="r2a", decisions=3)
    _balanced(core)
    _ship(core, round2[1], 0.0, ref="r2b")
    [group] = core.take(max_items=4)
    assert [refs[0] for _, refs in group] == ["first0", "first1", "r1a", "r1b", "r2a", "r2b"]
    assert {info.key for info, _ in group} == {K}
    stats = core.stats()
    assert stats.rescued_groups == 1 and stats.rescued_decisions == 23
    assert (stats.redrawn, stats.redrawn_decisions) == (4, 15)
    assert stats.uniform_groups == 0 and stats.held_episodes == 0
    _balanced(core)


def test_a_group_still_uniform_when_its_rounds_are_spent_is_skipped_and_counted():
    core = _core(rounds=1)
    _uniform_group(core)
    for t in [core.admit(0, "w0", OTHER, 0.0) for _ in range(2)]:
        _ship(core, t, 0.0)
    stats = core.stats()
    assert core.depth() == 0 and stats.held_episodes == 0
    assert (stats.redraws, stats.redrawn, stats.redraw_skipped_groups) == (1, 2, 1)
    assert (stats.uniform_groups, stats.uniform, stats.uniform_decisions) == (1, 4, 16)
    assert core.ticket_key(core.admit(0, "w0", OTHER, 0.0)) == OTHER  # nothing left to draw
    _balanced(core)


def test_without_skipping_a_group_still_uniform_after_its_rounds_is_trained():
    core = _core(rounds=1, skip_uniform=False)
    _uniform_group(core)
    for t in [core.admit(0, "w0", OTHER, 0.0) for _ in range(2)]:
        _ship(core, t, 0.0)
    [group] = core.take(max_items=4)
    assert len(group) == 4 and core.stats().uniform_groups == 0
    _balanced(core)


@pytest.mark.parametrize("loss", ["retire", "reset_worker", "close_admissions"])
def test_a_worker_lost_mid_redraw_leaks_no_ticket(loss):
    """The owner of a group drawing a round is lost with one redraw member running and one
    not yet admitted: its ticket is released, the round admits nobody else, and the group
    leaves with what it has (skipped: still uniform); no later admission runs its key."""
    core = _core(rounds=3, group_size=3)
    _uniform_group(core)
    running = core.admit(0, "w0", OTHER, 0.0)
    assert core.ticket_key(running) == K
    if loss == "retire":
        assert core.retire(0, "w0") == 1
    elif loss == "reset_worker":
        assert core.reset_worker(0, "w0-b") == 1
    else:
        core.close_admissions()
        core.cancel(running)  # the slot that held it stops without starting it
    stats = core.stats()
    assert stats.in_flight_episodes == 0 and stats.held_episodes == 0
    assert (stats.uniform_groups, stats.redraw_skipped_groups, stats.redraws) == (1, 1, 1)
    if loss == "reset_worker":  # the new incarnation runs what it asks for
        assert core.ticket_key(core.admit(0, "w0-b", OTHER, 0.0)) == OTHER
    _balanced(core)


def test_a_redraw_that_waits_too_long_expires_and_stops_drawing():
    core = _core(rounds=2, max_staleness=2)
    _uniform_group(core)
    late = core.admit(0, "w0", OTHER, 0.0)  # one member of the round running ...
    core.set_version(3)  # ... when the held members grow stale
    stats = core.stats()
    assert stats.expired_groups == 1 and stats.expired == 2 and stats.held_episodes == 0
    assert core.ticket_key(core.admit(0, "w0", OTHER, 0.0)) == OTHER  # the round stopped
    _ship(core, late, 1.0, version=3)  # counted expired as it arrives
    stats = core.stats()
    assert stats.expired == 3 and stats.redrawn == 1 and stats.rescued_groups == 0
    _balanced(core)


def test_redraw_rounds_zero_skips_a_uniform_group_at_once():
    core = _core(rounds=0)
    _uniform_group(core)
    stats = core.stats()
    assert (stats.uniform_groups, stats.redraws, stats.held_episodes) == (1, 0, 0)
    assert core.ticket_key(core.admit(0, "w0", OTHER, 0.0)) == OTHER
    _balanced(core)


def test_a_key_put_back_is_the_next_one_and_no_group_loses_a_member():
    """The slot that ran a redraw gives its own key back: the sampler's sequence goes on as
    if that key had been handed out now."""
    plain = TaskSampler([0, 1], [0, 1, 2], seed=4, repeat=3)
    swapped = TaskSampler([0, 1], [0, 1, 2], seed=4, repeat=3)
    expected = [plain.next() for _ in range(9)]
    got = [swapped.next()]
    swapped.put_back(got.pop())  # the first slot ran a redraw instead
    key = swapped.next()
    swapped.put_back(swapped.next())  # a copy of a group in progress, given back too
    got = [key] + [swapped.next() for _ in range(8)]
    assert got == expected


@pytest.mark.parametrize(("overrides", "says"), [
    (["algo.name=grpo", "algo.redraw_rounds=-1"], "must be >= 0"),
    (["algo.redraw_rounds=2"], "needs name grpo"),
    (["algo.name=grpo", "algo.redraw_rounds=2", "pipeline.mode=sync"], "async rollout"),
])
def test_redraw_rounds_is_refused_in_one_line_where_it_cannot_work(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_run_config("smoke", overrides=overrides)
    assert err.value.field == "algo.redraw_rounds" and says in str(err.value)
    assert "\n" not in str(err.value)


def test_settled_groups_are_counted_under_their_task():
    """Which tasks the updates come from: each settled group under its task as mixed, all
    failed or all succeeded, with the decisions it gave the learners (none when skipped);
    a group still drawing rounds is not settled yet."""
    core = _core(rounds=0)
    _uniform_group(core)  # task 3: both fail, skipped
    for rets in ((1.0, 1.0), (0.0, 1.0)):  # task 5: all succeeded (skipped), then mixed
        for t, ret in zip([core.admit(0, "w0", OTHER, 0.0) for _ in range(2)], rets,
                          strict=True):
            _ship(core, t, ret, decisions=3)
    assert core.stats().groups_by_task == {
        "3": {"mixed": 0, "all_failed": 1, "all_succeeded": 0, "queued_decisions": 0},
        "5": {"mixed": 1, "all_failed": 0, "all_succeeded": 1, "queued_decisions": 6}}
    kept = _core(rounds=0, skip_uniform=False)
    _uniform_group(kept)  # kept: its decisions go to the learners
    assert kept.stats().groups_by_task["3"] == {
        "mixed": 0, "all_failed": 1, "all_succeeded": 0, "queued_decisions": 8}
    drawing = _core(rounds=1)
    _uniform_group(drawing)  # held for another round: not settled
    assert drawing.stats().groups_by_task == {}
    _balanced(core)
