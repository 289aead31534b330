"""The paged KV cache: a page allocator and the per-layer cache tensors the megakernel writes.

Each layer l has k_cache.{l} and v_cache.{l} of shape [num_pages, page_size, kv_heads, head_dim]
bf16. A sequence owns a list of pages; position p of that sequence lives in page
pages[p // page_size], slot p % page_size. The caches are filled with noise when they are
allocated (never zeros), so a kernel that reads past a sequence's length shows up as a wrong
result instead of silently reading harmless zeros.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpk.errors import MpkError

log = logging.getLogger(__name__)

# Page-table entry of a slot that holds no page. Never read: the engine allocates every
# position a row can reach before it runs a launch.
NO_PAGE = -1


class OutOfPagesError(MpkError):
    """The page pool cannot hold the requested tokens."""


class PagePool:
    """Hands out page ids 0 .. num_pages-1. Lowest free ids first, so runs are reproducible."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise MpkError(f"a page pool needs num_pages > 0 and page_size > 0, got "
                           f"num_pages={num_pages}, page_size={page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages))  # kept sorted descending: pop() = lowest
        self._free.reverse()
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """How many pages hold `num_tokens` positions."""
        return -(-num_tokens // self.page_size)

    def allocate(self, num_tokens: int) -> list[int]:
        """Pages for `num_tokens` positions (at least one page), or OutOfPagesError."""
        if num_tokens < 0:
            raise MpkError(f"cannot allocate pages for {num_tokens} tokens")
        need = max(1, self.pages_for(num_tokens))
        if need > len(self._free):
            raise OutOfPagesError(
                f"KV cache out of pages: {num_tokens} tokens need {need} pages of "
                f"{self.page_size}, only {len(self._free)} of {self.num_pages} are free")
        pages = [self._free.pop() for _ in range(need)]
        self._used.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give pages back. Freeing a page that is not allocated is an error."""
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise MpkError(f"cannot free pages {list(pages)}: {bad or 'duplicates'} not allocated")
        self._used.difference_update(pages)
        self._free.extend(pages)
        self._free.sort(reverse=True)


@dataclass(frozen=True)
class KvShape:
    """The shape of a paged KV cache, for every layer."""

    num_layers: int
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.page_size, self.kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        n = self.num_pages * self.page_size * self.kv_heads * self.head_dim
        return 2 * self.num_layers * n * 2  # K and V, bf16


def cache_names(layer: int) -> tuple[str, str]:
    """Graph names of layer `layer`'s key and value caches."""
    return f"k_cache.{layer}", f"v_cache.{layer}"


class KvCache:
    """The cache tensors of every layer plus the page pool that divides them among sequences."""

    def __init__(self, shape: KvShape, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.shape = shape
        self.pool = PagePool(shape.num_pages, shape.page_size)
        self.tensors: dict[str, torch.Tensor] = {}
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        log.debug("allocating KV cache: %s (%.1f MiB)", shape, shape.nbytes / 2**20)
        for layer in range(shape.num_layers):
            for name in cache_names(layer):
                noise = torch.randn(shape.page_shape, generator=gen, device=device,
                                    dtype=torch.float32)
                self.tensors[name] = noise.to(torch.bfloat16)

    def page_table(self, rows: Sequence[Sequence[int]], max_pages: int) -> torch.Tensor:
        """[len(rows), max_pages] int32: each row's pages, NO_PAGE after them."""
        table = torch.full((len(rows), max_pages), NO_PAGE, dtype=torch.int32)
        for b, pages in enumerate(rows):
            if len(pages) > max_pages:
                raise MpkError(f"row {b} holds {len(pages)} pages, the page table has room for "
                               f"{max_pages}")
            table[b, : len(pages)] = torch.tensor(list(pages), dtype=torch.int32)
        return table
