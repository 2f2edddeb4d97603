"""The chunk schedule's rules (dilocod/data/schedule.py) and a trainer's cursor in it (dilocod/data/cursor.py)."""

from __future__ import annotations

import pytest

from dilocod.data.cursor import ChunkCursor, Segment
from dilocod.data.schedule import MAX_LEASES, ChunkBook, Grant, epoch_order

DATASET = "ab" * 32


def book(train_tokens: int = 1000, chunk_tokens: int = 100, lease_seconds: float = 10.0) -> ChunkBook:
    return ChunkBook(train_tokens, chunk_tokens, DATASET, lease_seconds)


def held(grants: list[Grant], offset: int | None = None) -> list[tuple[int, int, int]]:
    return [(g.epoch, g.chunk, g.offset if offset is None else offset) for g in grants]


def test_the_epoch_order_is_a_permutation_fixed_by_dataset_and_epoch() -> None:
    a, b = epoch_order(50, DATASET, 0), epoch_order(50, DATASET, 1)
    assert sorted(a.tolist()) == list(range(50))
    assert a.tolist() == epoch_order(50, DATASET, 0).tolist()
    assert a.tolist() != b.tolist()
    assert a.tolist() != epoch_order(50, "cd" * 32, 0).tolist()


def test_chunks_cover_the_split_and_the_last_is_shorter() -> None:
    b = book(train_tokens=950, chunk_tokens=100)
    assert b.n_chunks == 10
    assert [b.size(c) for c in (0, 8, 9)] == [100, 100, 50]


def test_claim_hands_out_distinct_chunks_in_the_epochs_order() -> None:
    b = book()
    order = epoch_order(10, DATASET, 0).tolist()
    a = b.sync("A", [], want=2, now=0)
    c = b.sync("C", [], want=2, now=0)
    assert [g.chunk for g in a + c] == order[:4]
    assert all(g.offset == 0 and g.lo == g.chunk * 100 and g.size == 100 for g in a + c)


def test_a_peer_holds_at_most_max_leases_and_asking_again_is_idempotent() -> None:
    b = book()
    first = b.sync("A", [], want=4, now=0)
    assert len(first) == MAX_LEASES
    assert b.sync("A", [], want=2, now=1) == first  # a restarted peer that remembers nothing gets its own


def test_reports_move_offsets_forward_only_and_record_segments() -> None:
    b = book()
    (g,) = b.sync("A", [], want=1, now=0)
    b.sync("A", [(g.epoch, g.chunk, 40)], want=1, now=1)
    (g2,) = b.sync("A", [(g.epoch, g.chunk, 30)], want=1, now=2)  # older news: ignored
    assert g2.offset == 40
    b.sync("A", [(g.epoch, g.chunk, 70)], want=1, now=3)
    assert b.segments() == [{"epoch": 0, "chunk": g.chunk, "peer": "A", "lo": 0, "hi": 70}]
    assert b.progress()["tokens_trained"] == 70


def test_a_finished_chunk_is_done_and_a_new_one_follows() -> None:
    b = book()
    (g,) = b.sync("A", [], want=1, now=0)
    (nxt,) = b.sync("A", [(g.epoch, g.chunk, 100)], want=1, now=1)
    assert nxt.chunk != g.chunk
    p = b.progress()
    assert (p["chunks_trained"], p["tokens_trained"], p["epoch_fraction"]) == (1, 100, 0.1)


def test_only_the_lessee_moves_a_lease() -> None:
    b = book()
    (g,) = b.sync("A", [], want=1, now=0)
    b.sync("B", [(g.epoch, g.chunk, 100)], want=0, now=1)
    assert b.progress()["tokens_trained"] == 0
    assert b.sync("A", [], want=1, now=2) == [g]


def test_a_dead_peers_chunk_goes_back_from_its_last_report() -> None:
    b = book(lease_seconds=10)
    (g,) = b.sync("A", [], want=1, now=0)
    b.sync("A", [(g.epoch, g.chunk, 60)], want=1, now=5)  # renewed until 15
    assert b.sync("B", [], want=1, now=14)[0].chunk != g.chunk  # still A's
    (back,) = b.sync("C", [], want=1, now=16)  # A's lease expired: C resumes where A reported
    assert (back.chunk, back.offset) == (g.chunk, 60)
    b.sync("C", [(back.epoch, back.chunk, 100)], want=0, now=17)
    parts = [s for s in b.segments() if s["chunk"] == g.chunk]
    assert [(s["peer"], s["lo"], s["hi"]) for s in parts] == [("A", 0, 60), ("C", 60, 100)]
    assert b.sync("A", [(g.epoch, g.chunk, 90)], want=0, now=18) == []  # too late: not A's any more


def test_no_chunk_is_trained_twice_in_an_epoch_and_the_next_epoch_opens() -> None:
    b = book(train_tokens=500, chunk_tokens=100)
    seen: list[tuple[int, int]] = []
    grants = {p: b.sync(p, [], want=2, now=0) for p in "AB"}
    for step in range(1, 20):
        for p in "AB":
            seen += [(g.epoch, g.chunk) for g in grants[p][:1]]
            grants[p] = b.sync(p, held(grants[p][:1], offset=100), want=2, now=step)
    epoch0 = [c for e, c in seen if e == 0]
    assert sorted(epoch0) == list(range(5))  # every chunk of epoch 0 once
    assert any(e == 1 for e, _ in seen)
    assert b.progress()["epoch"] >= 1 and b.progress()["chunks_trained"] >= 5


def test_a_book_survives_a_coordinator_restart() -> None:
    b = book()
    (g,) = b.sync("A", [], want=1, now=0)
    b.sync("A", [(g.epoch, g.chunk, 50)], want=1, now=1)
    again = book()
    again.restore(b.to_json(), now=1000)  # leases are renewed: the coordinator was the one away
    assert again.sync("A", [], want=1, now=1001) == [Grant(0, g.chunk, g.lo, 100, 50)]
    assert again.progress() == b.progress()
    with pytest.raises(ValueError, match="another dataset"):
        ChunkBook(1000, 50, DATASET, 10).restore(b.to_json(), now=0)


# ---- the trainer's cursor -----------------------------------------------------------------------------------


def test_windows_cover_a_chunk_each_token_a_target_once_in_a_seeded_order_then_the_next_chunk() -> None:
    cur = ChunkCursor(seq_len=10, seed="d")
    cur.adopt([Grant(0, 3, 300, 35, 0), Grant(0, 7, 700, 100, 0)])
    first = cur.windows(2)
    second = cur.windows(2)
    assert first is not None and second is not None
    assert sorted(first + second[:1]) == [300, 310, 320]  # 330..335 cannot fill a window: the chunk ends
    assert 700 <= second[1] < 790 and (second[1] - 700) % 10 == 0
    assert cur.drain() == [Segment(0, 3, 0, 35), Segment(0, 7, 0, 10)]
    assert cur.held() == [(0, 3, 35), (0, 7, 10)]
    again = ChunkCursor(seq_len=10, seed="d")  # the order is the chunk's: the same on every machine
    again.adopt([Grant(0, 3, 300, 35, 0), Grant(0, 7, 700, 100, 0)])
    assert again.windows(4) == first + second
    other = ChunkCursor(seq_len=10, seed="d")
    other.adopt([Grant(0, 7, 700, 100, 0)])
    taken = [w for _ in range(9) for w in other.windows(1) or []]
    assert sorted(taken) == list(range(700, 790, 10)) and taken != sorted(taken)


def test_no_window_when_the_leases_run_out_and_nothing_is_taken() -> None:
    cur = ChunkCursor(seq_len=10)
    cur.adopt([Grant(0, 0, 0, 25, 0)])
    assert cur.windows(3) is None
    assert cur.held() == [(0, 0, 0)]


def test_windows_stop_at_a_lease_whose_tokens_are_not_here_yet() -> None:
    cur = ChunkCursor(seq_len=10)
    cur.adopt([Grant(0, 0, 0, 21, 0), Grant(0, 1, 100, 100, 0)])
    cur.ready = lambda grant: grant.chunk == 0
    assert cur.windows(3) is None and cur.held() == [(0, 0, 0), (0, 1, 0)]
    cur.ready = lambda grant: True
    assert cur.windows(3) is not None


def test_adopt_keeps_the_further_offset_and_drops_what_is_no_longer_ours() -> None:
    cur = ChunkCursor(seq_len=10)
    cur.adopt([Grant(0, 1, 100, 100, 0), Grant(0, 2, 200, 100, 0)])
    cur.windows(3)
    left = cur.adopt([Grant(0, 1, 100, 100, 10), Grant(0, 5, 500, 100, 40)])  # 2 is gone; 1 lags; 5 new
    assert cur.held() == [(0, 1, 30), (0, 5, 40)]
    assert left == 6 + 5


def test_a_cursor_resumes_from_its_checkpoint() -> None:
    cur = ChunkCursor(seq_len=10, seed="d")
    cur.adopt([Grant(1, 4, 400, 100, 20)])
    again = ChunkCursor(seq_len=10, seed="d")
    again.load_state_dict(cur.state_dict())
    assert again.windows(1) == cur.windows(1)  # the third window of the chunk's order
    with pytest.raises(ValueError, match="not valid"):
        again.load_state_dict({"leases": [[0, 1, 0, 10, 11]]})
