"""The streaming schedule's buffer (``rollout.buffer.GroupBuffer``) against a simulated engine:
responses of random lengths, refits that interrupt them at random points, a trainer that takes
a batch per step. What must hold whatever the timing: every admitted prompt group is trained
exactly once and the stream has no gap, no trained token lags more than k updates, the engines
never run more than k + 1 batches ahead, and a checkpoint's buffer continues the same run."""

from __future__ import annotations

import copy
import random

import pytest

from megatron_dgpo.rollout.buffer import GroupBuffer

G = 4


class _Engine:
    """Holds the responses it was given; each tick adds one token to each, a response finishes
    at a length drawn from its seed stream (a long tail: mostly short, some 10x longer)."""

    def __init__(self, seed: int):
        self.seed, self.held, self.version = seed, {}, 0

    def give(self, responses):
        for r in responses:
            target = random.Random(hash((self.seed, r.key))).choice([2, 3, 4, 5, 40])
            self.held[r.key] = {"r": r, "target": target, "tokens": []}

    def tick(self, buffer: GroupBuffer) -> None:
        for key in list(self.held):
            held = self.held[key]
            held["tokens"].append(len(held["tokens"]))
            if len(held["r"].tokens) + len(held["tokens"]) >= held["target"]:
                self._report(buffer, self.held.pop(key), "stop")

    def interrupt(self, buffer: GroupBuffer, partial: bool) -> None:
        for key in list(self.held):
            if not partial:  # drain: the started ones finish first
                while key in self.held and self.held[key]["tokens"]:
                    self.tick(buffer)
            if key in self.held:
                self._report(buffer, self.held.pop(key), None)

    def _report(self, buffer, held, reason) -> None:
        r = held["r"]
        buffer.record({"position": r.position, "sample": r.sample, "tokens": held["tokens"],
                       "logprobs": [-1.0] * len(held["tokens"]), "version": self.version,
                       "finish_reason": reason, "reward": 1.0 if reason else None,
                       "prompt_index": r.position % 7, "prompt": [1, 2]})


def _assert_exactly_once(trained: list, buffer: GroupBuffer, stream: list[int]) -> None:
    """Each group trained at most once, and the trained ones with those still in the buffer
    are the admitted prefix of the replica's stream ``stream``: none lost, none skipped."""
    positions = [g[0].position for _, g in trained]
    assert len(positions) == len(set(positions))
    assert sorted(positions + list(buffer.groups)) == stream[:buffer.admitted]
    assert len(positions) == buffer.trained


def _run(buffer: GroupBuffer, engine: _Engine, steps: range, *, partial: bool, rng: random.Random,
         k: int, trained: list, version: int):
    """The trainer's loop: ``steps`` steps on ``buffer``, the refit before each (as the trainer
    refits after a step and at start). Returns the trained groups as (step, group)."""
    for step in steps:
        engine.interrupt(buffer, partial)
        engine.version = version = step - 1
        buffer.restart_stale(version)
        buffer.admit()
        assert buffer.admitted <= buffer.trained + (k + 1) * buffer.batch_groups  # backpressure
        engine.give(buffer.to_generate())
        for _ in range(rng.randrange(0, 12)):  # generation overlapping the previous update
            engine.tick(buffer)
        while (groups := buffer.take(step)) is None:
            engine.tick(buffer)
        trained += [(step, g) for g in groups]
    return version


@pytest.mark.parametrize("k, partial, mask", [(2, True, False), (1, True, False), (2, False, False),
                                               (3, True, True)])
def test_every_group_is_trained_once_within_the_staleness_bound(k, partial, mask):
    rng = random.Random(k * 10 + partial)
    buffer = GroupBuffer(batch_prompts=6, replica_prompts=range(3, 6), group_size=G,
                         max_staleness=k, mask_stale=mask)
    engine, trained = _Engine(1), []
    _run(buffer, engine, range(1, 41), partial=partial, rng=rng, k=k, trained=trained, version=0)
    # the replica's positions of each batch of 6, from the start, without a gap
    _assert_exactly_once(trained, buffer, [b * 6 + p for b in range(45) for p in range(3, 6)])
    assert buffer.trained == 40 * 3
    segmented = 0
    for step, group in trained:
        for r in group:
            assert [r.sample for r in group] == list(range(G))
            assert r.finish_reason == "stop" and len(r.tokens) == sum(n for _, n in r.segments)
            if not mask:
                assert step - 1 - r.oldest <= k  # no token older than k updates
            segmented += len(r.segments) > 1
    assert (segmented > 0) == partial  # only interrupted responses are continued
    if mask:  # some groups trained with old segments, which the step masks
        assert any(step - 1 - r.oldest > k for step, g in trained for r in g)


def test_a_checkpoints_buffer_continues_the_same_run():
    """Stopped after step 12 (the buffer as the refit left it: what a checkpoint keeps) and
    continued in a fresh buffer with a fresh engine: the groups trained are those the stopped
    run admitted, then the stream on, none twice, none skipped, the bound still held."""
    k = 2

    def fresh():
        return GroupBuffer(batch_prompts=4, replica_prompts=range(0, 4), group_size=G,
                           max_staleness=k, mask_stale=False)

    rng, buffer, trained = random.Random(3), fresh(), []
    engine = _Engine(5)
    _run(buffer, engine, range(1, 13), partial=True, rng=rng, k=k, trained=trained, version=0)
    engine.interrupt(buffer, True)  # the refit after step 12, where the checkpoint is taken
    saved = copy.deepcopy(buffer.state())
    assert saved["groups"] and any(r["tokens"] and r["finish_reason"] is None
                                   for g in saved["groups"].values() for r in g)
    resumed = fresh()
    resumed.load_state(saved)
    _run(resumed, _Engine(6), range(13, 31), partial=True, rng=rng, k=k, trained=trained,
         version=12)
    _assert_exactly_once(trained, resumed, list(range(40 * 4)))
    assert all(step - 1 - r.oldest <= k for step, g in trained for r in g)
    with pytest.raises(ValueError, match="same train.rollout_batch_prompts"):
        GroupBuffer(batch_prompts=8, replica_prompts=range(0, 4), group_size=G, max_staleness=k,
                    mask_stale=False).load_state(saved)


def test_stale_responses_start_over_on_a_fresh_stream_and_eligible_groups_go_oldest_first():
    buffer = GroupBuffer(batch_prompts=2, replica_prompts=range(0, 2), group_size=2,
                         max_staleness=1, mask_stale=False, start=10)
    assert buffer.admit() == [10, 11, 12, 13]  # (k + 1) batches of 2, from the start position
    held = {r.key: r for r in buffer.to_generate()}
    assert sorted(held) == [f"{p}:{j}:0" for p in (10, 11, 12, 13) for j in (0, 1)]
    assert buffer.to_generate() == []  # all held by the engines

    def report(position, sample, version, tokens, reason):
        buffer.record({"position": position, "sample": sample, "tokens": tokens,
                       "logprobs": [0.0] * len(tokens), "version": version,
                       "finish_reason": reason, "reward": 0.5 if reason else None,
                       "prompt_index": 0, "prompt": [1]})

    for position in (12, 13):
        for j in (0, 1):
            report(position, j, 0, [1, 2], "stop")
    report(10, 0, 0, [5], None)  # interrupted with one token
    report(10, 1, 0, [], None)  # never started
    report(11, 0, 0, [6, 7], None)
    report(11, 1, 0, [8], "length")
    group = buffer.groups[10]
    assert group[0].stream == 1 and group[1].stream == 0  # only a started segment takes a stream
    assert buffer.restart_stale(1) == 0  # at version 1, tokens of version 0 still train at step 2
    taken = buffer.take(2)  # the two finished groups, 12 and 13 (10 and 11 are not)
    assert [g[0].position for g in taken] == [12, 13] and buffer.take(2) is None
    assert buffer.restart_stale(2) == 3  # at version 2 they no longer can: 10:0, 11:0, 11:1
    assert group[0].tokens == [] and group[0].stream == 2 and buffer.groups[11][1].stream == 1
    assert buffer.dropped_tokens == 4
    for position in (10, 12):  # not given to an engine since; trained already
        with pytest.raises(RuntimeError, match="which no engine holds"):
            report(position, 1, 2, [1], "stop")
