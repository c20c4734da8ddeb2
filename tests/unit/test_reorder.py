from __future__ import annotations

import pytest

from remote_loader.server.sharing.reorder import Reorderer


def test_releases_in_order() -> None:
    r: Reorderer[str] = Reorderer()
    r.put(2, "c")
    r.put(1, "b")
    assert list(r.ready()) == []
    r.put(0, "a")
    assert list(r.ready()) == ["a", "b", "c"]
    assert r.next_id == 3 and len(r) == 0


def test_out_of_order_releases_at_once() -> None:
    r: Reorderer[str] = Reorderer(in_order=False)
    r.put(2, "c")
    assert list(r.ready()) == ["c"]
    r.put(0, "a")
    assert list(r.ready()) == ["a"]


@pytest.mark.parametrize("in_order", [True, False])
def test_duplicates_are_errors(in_order: bool) -> None:
    r: Reorderer[str] = Reorderer(in_order=in_order)
    r.put(1, "b")
    with pytest.raises(ValueError, match="task 1 was already received"):
        r.put(1, "b")
    if in_order:
        r.put(0, "a")
        list(r.ready())
        with pytest.raises(ValueError, match="task 0 was already received"):
            r.put(0, "a")
