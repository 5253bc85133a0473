"""Free-list allocators with exact accounting (pages of the KV pools, request slots)."""

from __future__ import annotations

from typing import Iterable, List


class KVCacheExhausted(RuntimeError):
    """Raised when an allocation cannot be satisfied; nothing was allocated."""


class FreeListAllocator:
    """Hands out integer ids from [first, first + count); every id is free or owned, never both."""

    def __init__(self, count: int, first: int = 0, what: str = "page"):
        if count <= 0:
            raise ValueError(f"{what} allocator needs a positive size, got {count}")
        self.what = what
        self.first = first
        self.capacity = count
        # Pop from the end so low ids go out first (keeps tests readable).
        self._free: List[int] = list(range(first + count - 1, first - 1, -1))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def alloc(self, n: int) -> List[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.what}s")
        if n > len(self._free):
            raise KVCacheExhausted(
                f"out of {self.what}s: need {n}, {len(self._free)} free of {self.capacity}"
            )
        ids = [self._free.pop() for _ in range(n)]
        self._owned.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if i not in self._owned:
                raise ValueError(f"double free or foreign {self.what} id {i}")
        for i in ids:
            self._owned.remove(i)
            self._free.append(i)


class RefCountedPageAllocator:
    """KV pages with a holder count: a page is free exactly when nobody holds it.

    Holders are requests (their page tables) and prefix-cache nodes; a page shared by a cached
    prefix and the requests reading it is freed only when the last of them lets it go."""

    def __init__(self, count: int, first: int = 0, what: str = "KV page"):
        if count <= 0:
            raise ValueError(f"{what} allocator needs a positive size, got {count}")
        self.what = what
        self.first = first
        self.capacity = count
        self._free: List[int] = list(range(first + count - 1, first - 1, -1))  # low ids out first
        self._refs: dict[int, int] = {}  # held page -> number of holders (>= 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def alloc(self, n: int) -> List[int]:
        """n free pages, each held once by the caller."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.what}s")
        if n > len(self._free):
            raise KVCacheExhausted(f"out of {self.what}s: need {n}, {len(self._free)} free of {self.capacity}")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for i in ids:
            if i not in self._refs:
                raise ValueError(f"cannot share free or foreign {self.what} {i}")
        for i in ids:
            self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> int:
        """Drop one hold on each page; returns how many became free."""
        ids = list(ids)
        drops: dict[int, int] = {}
        for i in ids:
            drops[i] = drops.get(i, 0) + 1
            if drops[i] > self._refs.get(i, 0):
                raise ValueError(f"double free or foreign {self.what} id {i}")
        freed = 0
        for i in ids:
            self._refs[i] -= 1
            if self._refs[i] == 0:
                del self._refs[i]
                self._free.append(i)
                freed += 1
        return freed
