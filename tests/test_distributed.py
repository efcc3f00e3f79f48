"""The gloo launcher itself: a rendezvous port taken by another process is retried on a new one,
and any other failure is reported, not retried; ranks (forked from a server that started with
an earlier launch) see the caller's environment of the moment, and a forked rank that imports
vLLM fails the launch."""

import os
import socket
import sys

import pytest

from tests import distributed


def _rank_and_size(rank, world):
    return rank, world


def _fails(rank, world):
    raise RuntimeError(f"rank {rank} fails on purpose")


def test_taken_port_is_retried_and_other_failures_are_not(monkeypatch):
    real_free_port = distributed.free_port
    with socket.socket() as holder:  # a port some other process holds, as under a busy CI box
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        handed = []

        def taken_first():
            handed.append(taken if not handed else real_free_port())
            return handed[-1]

        monkeypatch.setattr(distributed, "free_port", taken_first)
        assert distributed.run_ranks(_rank_and_size, 2) == [(0, 2), (1, 2)]
        assert len(handed) == 2 and handed[0] == taken  # one failed launch, one retry

        monkeypatch.setattr(distributed, "free_port", lambda: taken)  # taken on every attempt
        with pytest.raises(AssertionError, match="EADDRINUSE"):
            distributed.run_ranks(_rank_and_size, 2, attempts=2)

    monkeypatch.setattr(distributed, "free_port", real_free_port)
    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        distributed.run_ranks(_fails, 2)


def _imports_vllm(rank, world):
    import types

    sys.modules.setdefault("vllm", types.ModuleType("vllm"))  # as an engine's import would
    return rank


def test_a_forked_rank_that_imports_vllm_fails_the_launch():
    """A forked rank ends with os._exit, past vLLM's cleanup of its /dev/shm segments."""
    with pytest.raises(AssertionError, match="start_method='spawn'"):
        distributed.run_ranks(_imports_vllm, 1)


def _environment(rank, world):
    return os.environ.get("DGPO_TEST_RANKS_SEE"), os.environ["RANK"]


def test_ranks_see_the_callers_environment_of_the_moment(monkeypatch):
    monkeypatch.delenv("DGPO_TEST_RANKS_SEE", raising=False)
    assert distributed.run_ranks(_environment, 2) == [(None, "0"), (None, "1")]  # server started
    monkeypatch.setenv("DGPO_TEST_RANKS_SEE", "set after the server started")
    assert distributed.run_ranks(_environment, 2) == [("set after the server started", "0"),
                                                      ("set after the server started", "1")]
