"""A replica is the ranks that share one data-parallel index, TP x CP x PP
(``parallel.replica_group``): under context parallelism both CP ranks of a replica get its
samples, replicas get different ones, and the refit's export to a replica's first rank gathers
on CP rank 0 only. One launch of 4 gloo ranks (``tests/_rank_fns_replica.py``)."""

from __future__ import annotations

import pytest

from tests._rank_fns_replica import BATCH_PROMPTS, GROUP_SIZE, LAYOUTS, replicas_under_cp
from tests.distributed import run_ranks

WORLD = 4


@pytest.fixture(scope="module")
def ranks(tiny_model_dir):
    return run_ranks(replicas_under_cp, WORLD, str(tiny_model_dir))


def _expected(rank: int, tp: int, cp: int, pp: int) -> dict:
    """Megatron's order tp-cp-dp-pp: rank = t + TP (c + CP (d + DP p))."""
    dp = WORLD // (tp * cp * pp)
    t, c, d, p = rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp)
    replica = sorted(x + tp * (y + cp * (d + dp * z))
                     for x in range(tp) for y in range(cp) for z in range(pp))
    return dict(replica=replica, replica_group=replica, dp=(d, dp), dp_cp=(d * cp + c, dp * cp),
                cp=(c, cp), tp=(t, tp), pp=(p, pp))


def test_the_replica_is_tp_x_cp_x_pp_at_every_layout(ranks):
    for layout in LAYOUTS:
        key = tuple(layout.values())
        for rank, result in enumerate(ranks):
            assert result["membership"][key] == _expected(rank, *key), (layout, rank)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_cp_peers_share_their_replicas_samples_and_replicas_differ(ranks, placement):
    got = [r[placement] for r in ranks]
    # CP = 2, DP = 2: replicas {0, 1} and {2, 3}, each half of the batch's prompt groups
    assert [g["replica_prompts"] for g in got] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    for a, b in ((0, 1), (2, 3)):
        assert got[a]["responses"] == got[b]["responses"] and got[a]["prompts"] == got[b]["prompts"]
        assert got[a]["rewards"] == got[b]["rewards"]
    assert got[0]["responses"] != got[2]["responses"]
    assert all(len(g["responses"]) == BATCH_PROMPTS // 2 * GROUP_SIZE for g in got)
    assert [g["leader"] for g in got] == [True, False, True, False]


def test_each_engine_is_refitted_once_from_its_replica(ranks):
    colocated, separate = ([r[p] for r in ranks] for p in ("colocated", "separate"))
    # colocated: an engine on every rank, each fed the whole model once
    assert all(g["consumer"] == "all" and len(g["refit"]) == 1 for g in colocated)
    assert len({tuple(g["refit"][0]) for g in colocated}) == 1 and colocated[0]["refit"][0]
    # separate: the leader's engine only
    assert [g["has_engine"] for g in separate] == [True, False, True, False]
    assert separate[0]["refit"] == colocated[0]["refit"] == separate[2]["refit"]


def test_the_first_ranks_export_gathers_on_cp_rank_0_only(ranks):
    first, every = ([r[f"export_{c}"] for r in ranks] for c in ("first", "all"))
    # TP = 2, CP = 2, one replica: CP rank 0 is ranks 0 and 1
    assert first[0]["names"] == every[0]["names"] and first[0]["names"]
    assert [f["names"] == [] for f in first] == [False, True, True, True]
    assert first[0]["gathers"] == first[1]["gathers"] > 0
    assert first[2]["gathers"] == first[3]["gathers"] == 0
    # 'all': every rank gets the same tensors, each CP slice gathering its own
    assert len({e["digest"] for e in every}) == 1 and first[0]["digest"] == every[0]["digest"]
    assert len({e["gathers"] for e in every}) == 1
