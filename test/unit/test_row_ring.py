"""The buffer that a GPU server's kept rows are copied into (fingerprint/row_ring.py): a view
handed out keeps its rows for as long as it lives, whatever is copied in after it, and views
that follow each other join into one."""

from __future__ import annotations

import random

import torch

from sglang_rl.fingerprint.row_ring import RowRing

WIDTH = 8


def _rows(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, WIDTH, generator=gen)


def test_views_follow_each_other_and_join_into_one() -> None:
    gen = torch.Generator().manual_seed(0)
    ring = RowRing(64, torch.empty(0, WIDTH))
    sources = [_rows(n, gen) for n in (3, 16, 1, 9)]
    views = [ring.copy(s) for s in sources]
    assert all(v is not None for v in views)
    for view, source in zip(views, sources):
        assert torch.equal(view, source)
    joined = RowRing.join(views)
    assert len(joined.pieces) == 1 and torch.equal(joined.pieces[0], torch.cat(sources))
    assert joined.loose == [] and list(joined.rings) == [ring]


def test_join_keeps_order_across_other_tensors_and_a_wrap() -> None:
    """Views split by a tensor of their own, or by the ring's end, stay separate pieces: the
    pieces hold the same rows in the same order."""
    gen = torch.Generator().manual_seed(1)
    ring = RowRing(48, torch.empty(0, WIDTH))
    first = [ring.copy(_rows(10, gen)) for _ in range(4)]  # rows 0..40
    del first[0]  # rows 0..10 free again
    tail_view = ring.copy(_rows(10, gen))  # does not fit after row 40: wraps to row 0
    assert tail_view is not None and tail_view.data_ptr() == ring.data.data_ptr()
    alone = _rows(5, gen)
    parts = [first[0], alone, first[1], first[2], tail_view]
    joined = RowRing.join(parts)
    assert len(joined.pieces) == 4 and joined.loose == [alone]
    assert torch.equal(torch.cat(joined.pieces), torch.cat(parts))
    parts = [first[0], first[1], first[2], tail_view]
    pieces = RowRing.join(parts).pieces
    assert len(pieces) == 2
    assert torch.equal(torch.cat(pieces), torch.cat(parts))


def test_too_many_rows_are_refused() -> None:
    ring = RowRing(64, torch.empty(0, WIDTH))
    assert ring.copy(torch.zeros(17, WIDTH)) is None  # over a quarter of the ring
    assert ring.copy(torch.zeros(0, WIDTH)) is None
    assert ring.copy(torch.zeros(16, WIDTH)) is not None


class _Event:
    """A stand-in for a CUDA event: passed once `done` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_dead_view_waits_for_the_fence_after_its_reads() -> None:
    """A view read by a copy still in flight on the device is not reused when it dies, only once
    the event after that copy has passed."""
    ring = RowRing(40, torch.empty(0, WIDTH))
    views = [ring.copy(torch.full((10, WIDTH), float(i))) for i in range(4)]
    event = _Event()
    ring.fence(event)  # the views' rows are being read
    views.clear()
    assert ring.copy(torch.zeros(10, WIDTH)) is None
    event.done = True
    again = ring.copy(torch.ones(10, WIDTH))
    assert again is not None and again.data_ptr() == ring.data.data_ptr()


def test_random_traffic_never_overwrites_a_live_view() -> None:
    """Views of random sizes, mostly let go oldest first (as staged steps are written) but
    some kept longer: every live view keeps its rows, a copy is refused only while some view
    lives (a view let go behind a live one frees its region once the older ones are gone too),
    and once all are gone the whole ring is free again."""
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    ring = RowRing(100, torch.empty(0, WIDTH))
    live: list[tuple[torch.Tensor, torch.Tensor]] = []
    refused = wrapped = 0
    for _ in range(3000):
        source = _rows(rng.randint(1, 25), gen)
        view = ring.copy(source)
        if view is None:
            refused += 1
            assert live, "refused with no view alive"
        else:
            wrapped += view.data_ptr() == ring.data.data_ptr() and len(live) > 0
            live.append((view, source.clone()))
        view = None  # only `live` may hold views: a lingering name would keep one alive
        assert all(torch.equal(v, s) for v, s in live), "a live view was overwritten"
        while live and (len(live) > 6 or rng.random() < 0.3):
            live.pop(0 if rng.random() < 0.8 else rng.randrange(len(live)))
    assert refused > 50 and wrapped > 50
    live.clear()
    assert ring.copy(_rows(25, gen)).data_ptr() == ring.data.data_ptr()


def test_a_server_without_room_for_the_ring_clones_its_rows(monkeypatch, caplog) -> None:
    """The ring is allocated while the server runs: if the device has no room for it, kept rows
    are cloned step by step (with a warning) and the step goes on."""
    from sglang_rl.fingerprint import row_ring

    class _DeviceRows(torch.Tensor):
        """Host rows that say they are on a device, so keep makes a ring for them."""

        @property
        def is_cuda(self) -> bool:
            return True

    def no_room(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    rings = row_ring.RowRings()
    monkeypatch.setattr(row_ring, "RowRing", no_room)
    rows = torch.randn(6, WIDTH).as_subclass(_DeviceRows)
    with caplog.at_level("WARNING"):
        kept = [rings.keep(rows) for _ in range(3)]
    assert all(torch.equal(k, rows) and k.data_ptr() != rows.data_ptr() for k in kept)
    assert list(rings.by_kind.values()) == [None]
    assert sum("no room for the" in r.message for r in caplog.records) == 1
