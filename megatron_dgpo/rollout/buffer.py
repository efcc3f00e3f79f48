"""The streaming schedule's buffer: a DP replica's prompt groups from admission to training,
each response with its tokens, log-probs and the weight version of each segment; bookkeeping
only (the replica's leader holds it, ``dedicated.stream`` feeds it), saved in checkpoints.
With P groups of G responses per step and staleness bound k:

* admission (backpressure): groups enter in stream order while admitted < trained + (k + 1) P;
* step s trains P groups whose G responses are finished and whose oldest token has version
  >= s - 1 - k, oldest first (then by stream position);
* at a refit to version v a response with a token older than v - k starts over on a fresh seed
  stream (``mask_stale``: it stays, its old tokens masked by the step);
* every admitted group is trained exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Response:
    """One response of the group at stream ``position``: sample ``sample`` of G."""

    position: int
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens) per run
    stream: int = 0  # the seed stream (``placement.response_seed``'s segment) of its next tokens
    finish_reason: str | None = None
    reward: float | None = None
    prompt_index: int | None = None
    prompt_tokens: list[int] | None = None

    @property
    def key(self) -> str:
        return f"{self.position}:{self.sample}:{self.stream}"

    @property
    def oldest(self) -> int | None:
        """The version of its oldest token (None: no token yet)."""
        return min((v for v, _ in self.segments), default=None)

    def restart(self) -> int:
        """Forget every token and start over on the next stream; returns the tokens dropped."""
        dropped = len(self.tokens)
        self.tokens, self.logprobs, self.segments = [], [], []
        self.finish_reason = self.reward = None
        self.stream += 1
        return dropped


class GroupBuffer:
    """A replica's groups between admission and training (the module's rules). The replica
    trains the batch positions ``replica_prompts`` of every stream batch of ``batch_prompts``
    prompts (P = ``batch_groups``, their number); its stream begins at position ``start`` (a
    run resumed onto this schedule from another begins where that one stopped)."""

    def __init__(self, *, batch_prompts: int, replica_prompts: range, group_size: int,
                 max_staleness: int, mask_stale: bool, start: int = 0):
        self.batch_prompts, self.replica_prompts, self.start = batch_prompts, replica_prompts, start
        self.batch_groups, self.group_size = len(replica_prompts), group_size
        self.max_staleness, self.mask_stale = max_staleness, mask_stale
        self.admitted = self.trained = 0
        self.groups: dict[int, list[Response]] = {}
        self.in_flight: set[str] = set()
        self.restarted = self.dropped_tokens = 0  # since the last take

    def position_of(self, n: int) -> int:
        """The stream position of the replica's n-th group."""
        batch, offset = divmod(n, self.batch_groups)
        return self.start + batch * self.batch_prompts + self.replica_prompts.start + offset

    def admit(self) -> list[int]:
        """Admit the next groups the bound allows; their stream positions."""
        new = []
        while self.admitted < self.trained + (self.max_staleness + 1) * self.batch_groups:
            position = self.position_of(self.admitted)
            self.groups[position] = [Response(position, j) for j in range(self.group_size)]
            self.admitted += 1
            new.append(position)
        return new

    def to_generate(self) -> list[Response]:
        """The unfinished responses no engine holds, now marked as held."""
        out = [r for group in self.groups.values() for r in group
               if r.finish_reason is None and r.key not in self.in_flight]
        self.in_flight.update(r.key for r in out)
        return out

    def record(self, report: dict) -> None:
        """An engine's report on a response it held (``dedicated.server``): the tokens of its
        segment with their log-probs and version, and, when it finished, the finish reason,
        reward and prompt. An unfinished one (interrupted) is no longer held."""
        group = self.groups.get(report["position"])
        key = group[report["sample"]].key if group else f"{report['position']}:{report['sample']}"
        if key not in self.in_flight:
            raise RuntimeError(f"GroupBuffer: a report on response {key}, which no engine holds")
        response = group[report["sample"]]
        self.in_flight.discard(key)
        if report["tokens"]:
            response.tokens += report["tokens"]
            response.logprobs += report["logprobs"]
            response.segments.append((report["version"], len(report["tokens"])))
        if report["finish_reason"] is not None:
            response.finish_reason, response.reward = report["finish_reason"], report["reward"]
            response.prompt_index, response.prompt_tokens = report["prompt_index"], report["prompt"]
        elif report["tokens"]:
            response.stream += 1  # the next segment draws from a stream of its own

    def restart_stale(self, version: int) -> int:
        """At a refit to ``version``: the responses with a token older than ``version - k``
        (they could train no more) start over, unless stale tokens are masked. Returns how many."""
        if self.mask_stale:
            return 0
        count = 0
        for group in self.groups.values():
            for response in group:
                oldest = response.oldest
                if oldest is not None and oldest < version - self.max_staleness:
                    if response.key in self.in_flight:
                        raise RuntimeError(f"GroupBuffer.restart_stale: {response.key} is held "
                                           f"by an engine (interrupt them first)")
                    self.dropped_tokens += response.restart()
                    count += 1
        self.restarted += count
        return count

    def eligible(self, step: int) -> list[int]:
        """The groups step ``step`` may train: all G finished, the oldest token recent enough."""
        floor = step - 1 - self.max_staleness
        return [position for position, group in self.groups.items()
                if all(r.finish_reason is not None for r in group)
                and (self.mask_stale or min(r.oldest for r in group) >= floor)]

    def take(self, step: int) -> list[list[Response]] | None:
        """Step ``step``'s P groups (oldest tokens first, then stream position), out of the
        buffer; None while fewer are eligible."""
        ready = self.eligible(step)
        if len(ready) < self.batch_groups:
            return None
        ready.sort(key=lambda p: (min(r.oldest for r in self.groups[p]), p))
        self.trained += self.batch_groups
        return [self.groups.pop(p) for p in ready[:self.batch_groups]]

    def state(self) -> dict:
        """Everything to continue from, for a checkpoint (no engine may hold a response)."""
        if self.in_flight:
            raise RuntimeError(f"GroupBuffer.state: {len(self.in_flight)} responses are held by "
                               f"engines (interrupt them first)")
        return {"admitted": self.admitted, "trained": self.trained, "start": self.start,
                "batch_prompts": self.batch_prompts, "replica_prompts": self.replica_prompts,
                "group_size": self.group_size,
                "groups": {p: [vars(r).copy() for r in g] for p, g in self.groups.items()}}

    def load_state(self, state: dict) -> None:
        """Continue from ``state`` (``state()``'s), saved by the same replica of a run of the
        same batch and group sizes."""
        saved = (state["batch_prompts"], state["replica_prompts"], state["group_size"])
        if saved != (self.batch_prompts, self.replica_prompts, self.group_size):
            raise ValueError(f"the checkpoint's rollout buffer is of batches of {saved[0]} prompts "
                             f"(this replica's positions {saved[1]}) and groups of {saved[2]}; "
                             f"this run: {self.batch_prompts}, {self.replica_prompts}, "
                             f"{self.group_size}. Resume the streaming schedule with the same "
                             f"train.rollout_batch_prompts, rollout.group_size and DP size")
        self.admitted, self.trained, self.start = state["admitted"], state["trained"], state["start"]
        self.groups = {int(p): [Response(**r) for r in g] for p, g in state["groups"].items()}
        self.in_flight = set()
