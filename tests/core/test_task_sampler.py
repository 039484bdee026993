"""The task sampler (``rlvla3.episode.tasks``): tasks even all along, GRPO groups on free slots,
informative-task shares, weighted shares, and a state that resumes the same sequence."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlvla3.episode.tasks import InformativeTasks, TaskSampler
from rlvla3.types import EpisodeKey


def _one_pass(seed: int, repeat: int, lead: int, slots: int) -> tuple[list[EpisodeKey], int]:
    """200 keys of a 10-task x 20-state sampler, its slots asking in turn for their own task:
    the keys in the order handed out, and how often a slot changed task."""
    sampler = TaskSampler(range(10), range(20), seed=seed, repeat=repeat, lead=lead)
    last: list[int | None] = [None] * slots
    keys, switches = [], 0
    for i in range(200 * repeat):
        slot = i % slots
        key = sampler.next(last[slot])
        switches += last[slot] is not None and key.task_id != last[slot]
        last[slot] = key.task_id
        keys.append(key)
    return keys, switches


def _max_imbalance(keys: list[EpisodeKey], repeat: int, tasks: int) -> float:
    """The most any task's count of new keys strayed from an even share, over every prefix."""
    counts, worst = Counter(), 0.0
    for n, key in enumerate(keys[::repeat], start=1):
        counts[key.task_id] += 1
        worst = max(worst, max(abs(counts[t] - n / tasks) for t in range(tasks)))
    return worst


@pytest.mark.parametrize("lead", [0, 4])
def test_task_sampler_keeps_tasks_even_all_along_and_slots_on_their_tasks(lead):
    """Every task gets its share of new keys at every point of the run (within 2 keys, or
    lead x slots + 2 with a lead), so a
    short run trains them all; each task's states all come before one repeats; with a lead a
    slot keeps its task (fewer simulator rebuilds than taking keys in turn)."""
    keys, switches = _one_pass(seed=3, repeat=2, lead=lead, slots=2)
    assert _max_imbalance(keys, 2, 10) <= lead * 2 + 2  # 2 slots, each up to lead ahead
    if lead == 0:  # the first 10 keys (groups) already cover the 10 tasks
        assert len({k.task_id for k in keys[:2 * 10]}) == 10
    by_task: dict[int, list[int]] = {}
    for key in keys[::2]:
        by_task.setdefault(key.task_id, []).append(key.init_state_id)
    for states in by_task.values():  # each pass of a task's states has all 20, none twice
        for start in range(0, len(states), 20):
            assert len(set(states[start:start + 20])) == len(states[start:start + 20])
    if lead == 0:  # 200 keys: each task's 20 states once, each twice in a row (its group)
        assert Counter(keys) == Counter(EpisodeKey(t, s) for t in range(10) for s in range(20)
                                        for _ in "ab")
    assert keys == _one_pass(seed=3, repeat=2, lead=lead, slots=2)[0]  # seeded
    assert keys != _one_pass(seed=4, repeat=2, lead=lead, slots=2)[0]
    if lead:  # a slot taking keys in turn would change task on 9 in 10 of its keys
        assert switches < 0.2 * 2 * 200 * 9 / 10, switches


def test_task_sampler_with_a_long_lead_stays_longer_but_still_covers_every_task():
    short, short_switches = _one_pass(seed=5, repeat=1, lead=0, slots=4)
    long, long_switches = _one_pass(seed=5, repeat=1, lead=4, slots=4)
    assert long_switches < short_switches / 2, (long_switches, short_switches)
    assert _max_imbalance(short, 1, 10) <= 2 < _max_imbalance(long, 1, 10) <= 4 * 4 + 2
    with pytest.raises(ValueError, match="lead"):
        TaskSampler(range(2), range(2), seed=0, lead=-1)


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_task_sampler_starts_a_grpo_group_on_the_next_free_slots_whatever_their_task(slots):
    """A group's members are the next ``group_size`` episodes the worker starts, so it runs in
    ceil(group_size / slots) rounds of its slots, never more: a slot on another task takes the
    started group's copy rather than a key of its own task (which held the group back up to
    group_size rounds when slots stayed on their tasks)."""
    group_size, rounds = 4, -(-4 // slots)
    keys, _ = _one_pass(seed=7, repeat=group_size, lead=0, slots=slots)
    assert Counter(keys) == Counter(EpisodeKey(t, s) for t in range(10) for s in range(20)
                                    for _ in range(group_size))
    for start in range(0, len(keys), group_size):
        assert len(set(keys[start:start + group_size])) == 1, keys[start:start + group_size]
        first_round, last_round = start // slots, (start + group_size - 1) // slots
        assert last_round - first_round + 1 <= rounds


def test_informative_tasks_share_by_how_often_a_group_is_mixed():
    weights = InformativeTasks(range(3), group_size=8, window=20, floor=0.1)
    assert weights.shares() == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})  # none seen yet
    for i in range(20):
        weights.observe(0, i % 2 == 0)  # 10 of 20: p = 11/22 = 0.5
        weights.observe(1, False)  # 0 of 20: p = 1/22
        weights.observe(2, True)  # 20 of 20: p = 21/22
    p_low = 1 / 22
    mixed = {0: 1 - 2 * 0.5 ** 8, 1: 1 - p_low ** 8 - (1 - p_low) ** 8}
    mixed[2] = mixed[1]
    total = sum(mixed.values())
    expected = {t: 0.1 / 3 + 0.9 * m / total for t, m in mixed.items()}
    assert weights.shares() == pytest.approx(expected)
    assert sum(weights.shares().values()) == pytest.approx(1.0)
    assert weights.shares()[0] > 2 * weights.shares()[1]
    weights.observe(7, True)  # a task it does not sample is ignored
    assert set(weights.shares()) == {0, 1, 2}
    with pytest.raises(ValueError, match="floor"):
        InformativeTasks(range(3), group_size=8, floor=1.5)


def test_weighted_task_sampler_follows_the_shares_keeps_groups_and_cycles_states():
    """Keys follow the tasks' shares (within a key or two over a run), each task goes through
    all its initial states before repeating one, a group's copies come first, and a slot stays
    on its task while that task is owed keys."""
    group, slots = 4, 2
    weights = InformativeTasks(range(4), group_size=group, window=40, floor=0.0)
    for task, rate in enumerate([0.5, 0.5, 0.05, 0.0]):
        for i in range(40):
            weights.observe(task, i < rate * 40)
    shares = weights.shares()  # fixed: the test observes nothing more
    sampler = TaskSampler(range(4), range(5), seed=1, repeat=group, weighting=weights)
    last: list[int | None] = [None] * slots
    keys = []
    for i in range(400 * group):
        key = sampler.next(last[i % slots])
        last[i % slots] = key.task_id
        keys.append(key)
    groups = [keys[i:i + group] for i in range(0, len(keys), group)]
    assert all(len(set(g)) == 1 for g in groups)
    started = Counter(g[0].task_id for g in groups)
    for task, share in shares.items():
        assert abs(started[task] - 400 * share) <= 2, (task, started[task], 400 * share)
    assert started[0] > 3 * started[2] and started[3] >= 1
    by_task: dict[int, list[int]] = {}
    for g in groups:
        by_task.setdefault(g[0].task_id, []).append(g[0].init_state_id)
    for states in by_task.values():  # every pass of a task's states covers all five
        for start in range(0, len(states) - 4, 5):
            assert sorted(states[start:start + 5]) == list(range(5))
    assert _weighted_keys(weights, group, seed=1) == _weighted_keys(weights, group, seed=1)
    assert _weighted_keys(weights, group, seed=1) != _weighted_keys(weights, group, seed=2)
    switches = sum(a[0].task_id != b[0].task_id for a, b in zip(groups, groups[1:], strict=False))
    assert switches < 0.8 * len(groups), switches  # a task owed keys keeps its slot


def _weighted_keys(weighting: InformativeTasks, group: int, seed: int) -> list[EpisodeKey]:
    sampler = TaskSampler(range(4), range(5), seed=seed, repeat=group, weighting=weighting)
    return [sampler.next(None) for _ in range(40 * group)]


@pytest.mark.parametrize("informative", [False, True])
def test_task_sampler_state_resumes_the_same_sequence_through_json(informative):
    """A sampler restored from a saved state (through JSON, as a checkpoint's meta.json holds
    it), mid-group and mid-pass, hands out exactly the keys the original would have; without
    a state, or with one saved for other tasks, it starts a new sequence, not the old start."""
    def sampler(tasks=range(4)) -> TaskSampler:
        weighting = InformativeTasks(tasks, group_size=3, window=8) if informative else None
        return TaskSampler(tasks, range(5), seed=11, repeat=3, weighting=weighting)

    def take(s: TaskSampler, n: int) -> list[EpisodeKey]:
        keys = []
        for i in range(n):
            keys.append(s.next(keys[-1].task_id if i % 2 else None))
            s.observe(keys[-1].task_id, keys[-1].init_state_id % 2 == 0)
        return keys

    original = sampler()
    first = take(original, 22)  # 7 groups and one copy of the 8th: mid-group, mid-pass
    saved = json.loads(json.dumps(original.state()))
    resumed = sampler()
    assert resumed.restore(saved, salt=5)
    assert take(resumed, 60) == take(original, 60)
    assert resumed.state() == original.state()
    fresh = sampler()
    assert not fresh.restore(None, salt=22) and take(fresh, 30) != first[:30]
    other = sampler(range(3))
    assert not other.restore(saved, salt=22)  # saved for 4 tasks: a new sequence
    assert {k.task_id for k in take(other, 30)} == {0, 1, 2}
