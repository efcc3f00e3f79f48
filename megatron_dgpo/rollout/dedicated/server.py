"""A dedicated engine's rank: it joins the rollout's own world and its replica's link, then runs
the leader's commands (``start``, ``generate``, ``refit``, ``stop``; see the package) until
``stop``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_dgpo.algorithm.batch import Experience
from megatron_dgpo.rollout.config import RolloutConfig
from megatron_dgpo.rollout.dedicated.wire import dedicated_layout, open_link, receive_bucket
from megatron_dgpo.rollout.generate import (build_engine, degenerate_groups, generate_experience,
                                            refill_degenerate_groups, reward_pool)
from megatron_dgpo.rollout.base import ResponseRequest
from megatron_dgpo.rollout.placement import DedicatedLayout, response_seed, shard_prompts
from megatron_dgpo.runtime import comm
from megatron_dgpo.runtime.hub import on_this_node
from megatron_dgpo.runtime.parallel import (ParallelConfig, engine_group, init_distributed,
                                             split_world)
from megatron_dgpo.tasks import prompts


def serve(rollout: RolloutConfig, data: prompts.DataConfig, parallel: ParallelConfig, *,
          seed: int) -> int:
    """The main of a rollout rank: join the rollout world and this engine's replica, then run
    the leader's commands until ``stop``. ``rollout``, ``data`` and ``parallel`` are the
    recipe's sections, ``seed`` its ``train.seed``. Returns 0."""
    init_distributed(timeout_minutes=parallel.timeout_minutes,
                     watchdog_minutes=parallel.watchdog_minutes,
                     tensor_parallel=1,  # Megatron's CUDA_DEVICE_MAX_CONNECTIONS is not vLLM's
                     rollout_ranks=rollout.num_gpus)
    side = split_world(rollout.num_gpus)
    layout = dedicated_layout(rollout, parallel, side.trainer_size)
    group = engine_group(layout.engine_tp)  # before the engine: a collective of the rollout world
    replica = layout.replica_of(side.rank)
    link = open_link(layout, replica, layout.link_index(side.rank), parallel.timeout_minutes)
    server = _EngineServer(rollout, data, seed, layout, link, group,
                           leader=side.rank % layout.engine_tp == 0,
                           engine_index=layout.engine_in_replica(side.rank))
    try:
        server.run()
    finally:
        server.close()
    return 0


class _EngineServer:
    """One engine rank: builds vLLM on ``start``, then generates and refits on command."""

    def __init__(self, rollout: RolloutConfig, data: prompts.DataConfig, seed: int,
                 layout: DedicatedLayout, link, group, *, leader: bool, engine_index: int):
        self.config, self.data, self.seed = rollout, data, seed
        self.layout, self.link, self.group = layout, link, group
        self.leader, self.engine_index = leader, engine_index
        self.engine = self.pool = None
        self.version = 0

    def run(self) -> None:
        # idle: the wall time between two batches' reports not spent generating or refitting
        # (waiting for a command, or for the trainer to take the previous batch)
        last_report, busy = time.perf_counter(), 0.0
        while True:
            command = self.link.broadcast_object(None)
            kind, begin = command["kind"], time.perf_counter()
            if kind == "start":
                self._start(on_this_node(command["hf_dir"], command["snapshot"]))
                if self.config.streaming:
                    return _StreamingServer(self).run()
                last_report = time.perf_counter()
            elif kind == "generate":
                piece, stats = self._generate(command)
                now = time.perf_counter()
                stats["idle_s"] = max(now - last_report - busy - (now - begin), 0.0)
                last_report, busy = now, 0.0
                if self.leader:
                    self.link.send_object((piece, stats), 0)
            elif self.link_command(command):
                return
            else:
                busy += time.perf_counter() - begin

    def link_command(self, command: dict) -> bool:
        """Run ``refit`` (answering ``ok`` or the error) or ``stop`` (the engine shut down);
        True after ``stop``."""
        if command["kind"] == "refit":
            self.link.send_object(self._refit(command["version"]), 0)
            return False
        if command["kind"] == "stop":
            self.close()
            self.link.send_object("stopped", 0)  # before the trainer exits: a trainer that
            return True  # exits 75 first would have torchrun kill this rank (-15)
        raise ValueError(f"dedicated engine: unknown command {command['kind']!r}")

    def _start(self, hf_dir: Path) -> None:
        self.prompts, self.tokenizer = prompts.load_prompts(self.data, hf_dir,
                                                         self.config.max_prompt_tokens)
        self.engine = build_engine(self.config, hf_dir, seed=self.seed, placement="colocated",
                                   tensor_parallel_size=self.layout.engine_tp, refitted=True,
                                   dedicated=True)
        if self.leader:
            self.pool = reward_pool()
            print(f"dgpo-train: dedicated engine {dist.get_rank() // self.layout.engine_tp} of "
                  f"{self.layout.num_engines} (TP {self.layout.engine_tp}) on rollout rank "
                  f"{dist.get_rank()}", file=sys.stderr, flush=True)

    def _generate(self, command: dict) -> tuple[Experience | None, dict]:
        """This engine's share of the replica's positions, with DAPO's refill rounds (a
        position's fate depends only on its own stream: the same as on any placement)."""
        start, batch_prompts = command["start"], command["batch_prompts"]
        positions = command["positions"]
        mine = [positions[j] for j in shard_prompts(len(positions), self.layout.engines_per_replica,
                                                    self.engine_index)]
        begin, group = time.perf_counter(), self.config.group_size

        def redo(piece: Experience | None) -> tuple[list[int], int]:
            # the engine's leader grades; its TP peers sample again what it says
            groups = comm.broadcast_object(
                None if piece is None else degenerate_groups(piece, group),
                src=dist.get_rank() - dist.get_rank() % self.layout.engine_tp, group=self.group)
            return groups, len(groups)

        piece, rounds, discarded = refill_degenerate_groups(
            self._sample(start, batch_prompts, mine), mine, command["refill_rounds"],
            start=start, batch_prompts=batch_prompts, group_size=group,
            sample=lambda at, share: self._sample(at, batch_prompts, share), redo=redo)
        if piece is not None:
            piece.policy_version = self.version
        tokens = sum(len(r) for r in piece.response_tokens) if piece is not None else 0
        return piece, {"generation_s": time.perf_counter() - begin, "tokens": tokens,
                       "prompts": len(mine), "rounds": rounds, "discarded": discarded}

    def _sample(self, start: int, batch_prompts: int, positions: list[int]) -> Experience | None:
        if not positions:
            return Experience([], [], [], [], []) if self.leader else None
        indices = prompts.prompt_order(len(self.prompts), self.seed, start, batch_prompts)
        return generate_experience(self.engine, self.pool, self.tokenizer, self.prompts, indices,
                                   positions, self.config, train_seed=self.seed,
                                   prompts_consumed=start)

    def _refit(self, version: int) -> str:
        """Receive buckets until ``end`` and reload each; "ok" or the first error (the
        remaining buckets are still received, so the trainer's broadcasts never hang)."""
        error = None
        try:
            self.engine.begin_refit()
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, which raises
            error = f"{type(exc).__name__}: {exc}"
        while True:
            message = self.link.broadcast_object(None)
            if message["kind"] == "end":
                break
            bucket = receive_bucket(self.link, message["tensors"])
            if error is None:
                try:
                    self.engine.load_bucket(bucket)
                except Exception as exc:  # noqa: BLE001
                    error = f"{type(exc).__name__}: {exc}"
        if error is None:
            try:
                self.engine.end_refit()
                self.version = version
            except Exception as exc:  # noqa: BLE001
                error = f"{type(exc).__name__}: {exc}"
        return "ok" if error is None else f"rollout rank {dist.get_rank()}: {error}"

    def close(self) -> None:
        for closer in (self.engine and self.engine.shutdown, self.pool and self.pool.close):
            if closer:
                closer()
        self.engine = self.pool = None


class _StreamingServer:
    """The streaming schedule on an engine rank: responses sampled one engine step at a time
    (``add_requests`` / ``step``), each finished one graded and sent to the replica's leader
    over the link's ``Channel``, whose commands arrive between two steps: ``work`` (position,
    sample, tokens so far, seed stream: a continued response is prefilled again),
    ``interrupt`` (partial: abort all and hand back the unfinished; else abort the unstarted and
    finish the others; then the times since the last one) and ``link`` (join the link's next
    command: refit or stop). An engine's TP leader hands each command to its TP peers."""

    def __init__(self, server: _EngineServer):
        self.server, self.engine, self.config = server, server.engine, server.config
        self.channel = server.link.open_channel("stream", peers=[0] if server.leader else [])
        self.held: dict[str, dict] = {}  # request key -> its work item, prompt and new tokens
        self.orders: dict[int, list[int]] = {}  # the prompt order of each epoch met
        self._reset_stats()

    def _reset_stats(self) -> None:
        self.stats = {"generation_s": 0.0, "idle_s": 0.0, "tokens": 0, "reprefill_tokens": 0}

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            if self.server.leader:  # the leader would wait for a report for ever
                self.channel.send(("error", f"rollout rank {dist.get_rank()}: "
                                            f"{type(exc).__name__}: {exc}"), 0)
                self.channel.close()
            raise

    def _loop(self) -> None:
        draining = False
        while True:
            command = None
            if self.server.leader:
                begin = time.perf_counter()
                got = self.channel.receive(timeout=0 if self.held else None)
                if not self.held:
                    self.stats["idle_s"] += time.perf_counter() - begin
                command = got and got[1]
            if self.server.layout.engine_tp > 1:
                command = comm.broadcast_object(command, src=self._tp_leader(), group=self.server.group)
            if command is not None:
                kind = command["kind"]
                if kind == "work":
                    self._add(command["items"])
                elif kind == "interrupt":
                    draining = self._interrupt(command["partial"])
                elif kind == "link":
                    self.engine.abort(list(self.held))  # nothing runs through a refit or a stop
                    self.held.clear()
                    if self.server.link_command(self.server.link.broadcast_object(None)):
                        self._close()
                        return
                else:
                    raise ValueError(f"dedicated engine: unknown streaming command {kind!r}")
            if self.held:
                self._step()
            if draining and not self.held:
                self._report_interrupted([])
                draining = False

    def _tp_leader(self) -> int:
        return dist.get_rank() - dist.get_rank() % self.server.layout.engine_tp

    def _dataset_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.server.prompts))
        if epoch not in self.orders:
            self.orders[epoch] = prompts.prompt_order(len(self.server.prompts), self.server.seed,
                                                      epoch * len(self.server.prompts),
                                                      len(self.server.prompts))
        return self.orders[epoch][offset]

    def _add(self, items: list[tuple]) -> None:
        requests = []
        for position, sample, tokens, stream in items:
            index = self._dataset_index(position)
            prompt = list(self.server.prompts[index][1])
            request = ResponseRequest(
                f"{position}:{sample}:{stream}", prompt + list(tokens),
                self.config.max_response_tokens - len(tokens),
                response_seed(self.server.seed, position, self.config.group_size, sample, stream))
            self.held[request.key] = {"position": position, "sample": sample, "before": list(tokens),
                                      "index": index, "prompt": prompt, "tokens": [], "logprobs": []}
            if tokens:  # the KV of the prompt and the response so far is computed again
                self.stats["reprefill_tokens"] += len(prompt) + len(tokens)
            requests.append(request)
        self.engine.add_requests(requests, temperature=self.config.temperature,
                                 top_p=self.config.top_p)

    def _step(self) -> None:
        begin = time.perf_counter()
        finished = []
        for progress in self.engine.step():
            held = self.held[progress.key]
            held["tokens"] += progress.token_ids
            held["logprobs"] += progress.logprobs
            self.stats["tokens"] += len(progress.token_ids)
            if progress.finish_reason is not None:
                finished.append((self.held.pop(progress.key), progress.finish_reason))
        self.stats["generation_s"] += time.perf_counter() - begin
        if finished and self.server.leader:
            tokenizer, pool = self.server.tokenizer, self.server.pool
            texts = [tokenizer.decode(h["before"] + h["tokens"], skip_special_tokens=True)
                     for h, _ in finished]
            truths = [self.server.prompts[h["index"]][0].ground_truth for h, _ in finished]
            rewards = pool.score(texts, truths, grader="train")
            self.channel.send(("done", [self._report(h, reason, float(reward))
                                        for (h, reason), reward in zip(finished, rewards)]), 0)

    def _report(self, held: dict, finish_reason: str | None, reward: float | None) -> dict:
        return {"position": held["position"], "sample": held["sample"], "tokens": held["tokens"],
                "logprobs": held["logprobs"], "version": self.server.version,
                "finish_reason": finish_reason, "reward": reward, "prompt_index": held["index"],
                "prompt": held["prompt"] if finish_reason is not None else None}

    def _interrupt(self, partial: bool) -> bool:
        """Abort (partial: every request; else the unstarted ones) and report them; True while
        started requests still have to finish."""
        stopped = [k for k, h in self.held.items() if partial or not h["tokens"]]
        self.engine.abort(stopped)
        reports = [self._report(self.held.pop(k), None, None) for k in stopped]
        if self.held:
            if self.server.leader:
                self.channel.send(("done", reports), 0)
            return True
        self._report_interrupted(reports)
        return False

    def _report_interrupted(self, reports: list[dict]) -> None:
        if self.server.leader:
            self.channel.send(("interrupted", reports, self.stats), 0)
        self._reset_stats()

    def _close(self) -> None:
        """After ``stop``: this side closed, and the leader's close awaited (bounded), so no
        message is left half-sent when the rank exits."""
        self.channel.close()
        deadline = time.monotonic() + 60
        while self.channel.listening and time.monotonic() < deadline:
            time.sleep(0.01)
