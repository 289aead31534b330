"""The page allocator and the KV-cache tensors."""

from __future__ import annotations

import pytest
import torch

from mpk.engine.kv_cache import NO_PAGE, KvCache, KvShape, OutOfPagesError, PagePool
from mpk.errors import MpkError


def test_allocate_rounds_up_to_pages_and_hands_out_lowest_ids() -> None:
    pool = PagePool(num_pages=8, page_size=4)
    assert pool.allocate(5) == [0, 1]
    assert pool.allocate(4) == [2]
    assert pool.allocate(0) == [3]  # a sequence always owns at least one page
    assert pool.num_free == 4


def test_free_returns_pages_for_reuse() -> None:
    pool = PagePool(num_pages=4, page_size=2)
    a = pool.allocate(4)
    b = pool.allocate(4)
    pool.free(a)
    assert pool.num_free == 2
    assert pool.allocate(3) == a
    pool.free(b)
    with pytest.raises(MpkError, match="not allocated"):
        pool.free(b)


def test_out_of_pages_is_a_clear_error() -> None:
    pool = PagePool(num_pages=3, page_size=16)
    pool.allocate(20)
    with pytest.raises(OutOfPagesError, match=r"out of pages: 40 tokens need 3 pages of 16, "
                                              r"only 1 of 3 are free"):
        pool.allocate(40)
    assert pool.num_free == 1  # a failed allocation takes nothing


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 16), (4, 0)])
def test_bad_pool_sizes(num_pages: int, page_size: int) -> None:
    with pytest.raises(MpkError):
        PagePool(num_pages, page_size)


def test_cache_tensors_are_noise_not_zeros() -> None:
    shape = KvShape(num_layers=2, num_pages=3, page_size=4, kv_heads=2, head_dim=8)
    cache = KvCache(shape, seed=1)
    assert sorted(cache.tensors) == ["k_cache.0", "k_cache.1", "v_cache.0", "v_cache.1"]
    for t in cache.tensors.values():
        assert t.shape == (3, 4, 2, 8)
        assert t.dtype == torch.bfloat16
        assert (t != 0).float().mean() > 0.99
    assert not torch.equal(cache.tensors["k_cache.0"], cache.tensors["v_cache.0"])
    assert shape.nbytes == 2 * 2 * 3 * 4 * 2 * 8 * 2


def test_page_table_pads_with_no_page() -> None:
    cache = KvCache(KvShape(1, 4, 2, 1, 2))
    table = cache.page_table([[2, 0], [1]], max_pages=3)
    assert table.dtype == torch.int32
    assert table.tolist() == [[2, 0, NO_PAGE], [1, NO_PAGE, NO_PAGE]]
    with pytest.raises(MpkError, match="room for 1"):
        cache.page_table([[0, 1]], max_pages=1)
