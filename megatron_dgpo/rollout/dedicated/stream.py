"""The replica leader's side of the streaming schedule (``rollout.max_staleness`` >= 2 or
``rollout.partial``): its ``GroupBuffer`` fed by the engines' reports, which arrive on the
link's ``Channel`` while the trainer trains, the interrupt before a refit and the work after it
(``dedicated.server`` runs the engines' side)."""

from __future__ import annotations

import time

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.buffer import GroupBuffer, Response
from megatron_dgpo.rollout.placement import DedicatedLayout


class StreamLeader:
    """A replica leader's buffer and the engines it feeds: ``take`` a step's groups, and
    around a refit ``interrupt`` then ``resume``. ``replica_prompts``: the batch positions of
    the replica (its groups of every stream batch of ``batch_prompts``)."""

    def __init__(self, link, layout: DedicatedLayout, config, *, replica_prompts: range,
                 batch_prompts: int):
        self.config, self.layout = config, layout
        self.engines = [1 + i * layout.engine_tp for i in range(layout.engines_per_replica)]
        self.channel = link.open_channel("stream", peers=self.engines)
        self.buffer = GroupBuffer(
            batch_prompts=batch_prompts, replica_prompts=replica_prompts,
            group_size=config.group_size, max_staleness=config.max_staleness,
            mask_stale=config.mask_stale_segments)
        self.snapshot = self.buffer.state()  # what a checkpoint keeps: the last refit's buffer
        self.stats: list[dict] = []  # the engines' reports since the last take
        self.wait_s = 0.0
        self._taken_batches = 0  # stream batches admitted at the last take

    def take(self, step: int) -> tuple[Experience, dict, int]:
        """Step ``step``'s groups (waits for the engines until enough are eligible), the
        replica's rollout statistics (sums; the client reduces them) and the stream batches
        admitted since the last take."""
        begin = time.perf_counter()
        self._receive(block=False)
        while (groups := self.buffer.take(step)) is None:
            self._receive(block=True)
        self.wait_s = time.perf_counter() - begin
        batches = self.buffer.admitted // self.buffer.batch_groups
        admitted, self._taken_batches = batches - self._taken_batches, batches
        stats = {"wait_s": self.wait_s, "restarted": self.buffer.restarted,
                 "dropped_tokens": self.buffer.dropped_tokens,
                 "buffered_groups": len(self.buffer.groups), "engines": self.stats}
        self.buffer.restarted = self.buffer.dropped_tokens = 0
        self.stats = []
        return _experience(groups), stats, admitted

    def interrupt(self) -> None:
        """Stop every engine for a refit and take back what it holds (partial: the unfinished
        responses as they stand; otherwise the started ones finish first); the buffer is then
        complete, and kept as the checkpoint's."""
        for engine in self.engines:
            self.channel.send({"kind": "interrupt", "partial": self.config.partial}, engine)
        pending = set(self.engines)
        while pending:
            pending.discard(self._handle(*self._next()))
        self.snapshot = self.buffer.state()

    def before_link(self) -> None:
        """Each engine takes part in the link's next command (a refit, or stop)."""
        for engine in self.engines:
            self.channel.send({"kind": "link"}, engine)

    def resume(self, version: int) -> None:
        """After the refit to ``version``: the responses too old to train start over, new
        groups are admitted up to the bound, and every unfinished response goes to an engine."""
        self.buffer.restart_stale(version)
        self.buffer.admit()
        shares: dict[int, list] = {engine: [] for engine in self.engines}
        for response in self.buffer.to_generate():
            engine = self.engines[response.position % len(self.engines)]
            shares[engine].append((response.position, response.sample, response.tokens,
                                   response.stream))
        for engine, items in shares.items():
            if items:
                self.channel.send({"kind": "work", "items": items}, engine)

    def load(self, state: dict | None, prompts_consumed: int) -> None:
        """Continue from a checkpoint's buffer, or without one from stream position
        ``prompts_consumed`` (a run resumed onto this schedule); before the first refit."""
        if state is not None:
            self.buffer.load_state(state)
        else:
            self.buffer.start = prompts_consumed
        self.snapshot = self.buffer.state()
        self._taken_batches = self.buffer.admitted // self.buffer.batch_groups

    def close(self) -> None:
        self.channel.close()

    def _next(self) -> tuple[int, tuple]:
        got = self.channel.receive()
        assert got is not None
        return got

    def _receive(self, *, block: bool) -> None:
        """The engines' reports that arrived (``block``: at least one, waiting for it)."""
        while (got := self.channel.receive(timeout=None if block else 0)) is not None:
            self._handle(*got)
            block = False

    def _handle(self, src: int, message: tuple) -> int | None:
        """One report into the buffer; the engine's index when it says it is interrupted."""
        kind = message[0]
        if kind == "error":
            raise RuntimeError(f"dedicated engine failed: {message[1]}")
        for report in message[1]:
            self.buffer.record(report)
        if kind == "interrupted":
            self.stats.append(message[2])
            return src
        return None


def _experience(groups: list[list[Response]]) -> Experience:
    """The groups as a batch: each response with its prompt, segments and position."""
    responses = [r for group in groups for r in group]
    batch = Experience(prompt_tokens=[list(r.prompt_tokens) for r in responses],
                       response_tokens=[list(r.tokens) for r in responses],
                       rollout_logprobs=[list(r.logprobs) for r in responses],
                       rewards=[float(r.reward) for r in responses],
                       truncated=[r.finish_reason == "length" for r in responses],
                       prompt_indices=[r.prompt_index for r in responses],
                       positions=[r.position for r in responses],
                       segments=[list(r.segments) for r in responses])
    batch.policy_version = min((r.oldest for r in responses), default=None)
    return batch
