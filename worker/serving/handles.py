"""A worker's table of resume handles: ownership, LRU order, a TTL, a byte budget, a count limit
and tombstones (a late call learns *why* its handle is gone). No Ray, no asyncio, no torch:
freeing a handle's memory is the `free` callable the worker passes in."""
from __future__ import annotations

import collections
import secrets
import time
from dataclasses import dataclass
from typing import Callable

TOMBSTONES = 65536  # remembered dead handles

GONE_TEXT = {"HANDLE_EXPIRED": "the handle expired after {ttl:g} s unused",
             "HANDLE_EVICTED": "the handle was evicted to make room under the handle byte budget",
             "HANDLE_NOT_FOUND": "no such resume handle (never built, or freed)"}


class HandleGone(LookupError):
    """The token names no resident handle; `reason` says why (HANDLE_NOT_FOUND / _EXPIRED / _EVICTED)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class NotOwner(PermissionError):
    """The handle belongs to another caller."""


class BudgetExhausted(MemoryError):
    """The handle cannot fit the byte budget or the count limit, even after evicting idle ones."""


@dataclass
class Entry:
    handle: object
    owner: str
    nbytes: int
    last_used: float
    active: int = 0  # resumes streaming from it now (never evicted or expired meanwhile)


class HandleTable:
    def __init__(self, free: Callable[[object], None], budget_bytes: int, ttl_s: float, max_handles: int,
                 clock=time.monotonic):
        self._free = free
        self.budget_bytes, self.ttl_s, self.max_handles = budget_bytes, ttl_s, max_handles
        self.clock = clock
        self._entries: collections.OrderedDict[bytes, Entry] = collections.OrderedDict()  # LRU order
        self._tombstones: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fits_budget(self, nbytes: int) -> bool:
        """Whether a handle of nbytes could ever fit (evicting every idle handle)."""
        return nbytes <= self.budget_bytes

    def make_room_for_one(self) -> None:
        """Before building a handle: BudgetExhausted when the count limit cannot be met."""
        self.sweep()
        if len(self._entries) >= self.max_handles and not self._evict(0, count=True):
            raise BudgetExhausted(f"holds {len(self._entries)} handles (max {self.max_handles})")

    def put(self, handle, owner: str, nbytes: int) -> bytes:
        """Register a built handle under a new random token (evicting LRU idle handles to fit);
        BudgetExhausted when it cannot fit beside the handles that resumes are streaming from
        (the caller frees it then)."""
        if not self._evict(nbytes):
            raise BudgetExhausted(f"a handle of {nbytes} bytes does not fit the handle budget of "
                                  f"{self.budget_bytes} bytes beside the {len(self._entries)} resident handles "
                                  f"that resumes are streaming from")
        token = secrets.token_bytes(16)
        self._entries[token] = Entry(handle, owner, nbytes, self.clock())
        self.nbytes += nbytes
        return token

    def lookup(self, caller: str, token: bytes, touch: bool = True) -> Entry:
        self.sweep()
        entry = self._entries.get(token)
        if entry is None:
            reason = self._tombstones.get(token, "HANDLE_NOT_FOUND")
            raise HandleGone(reason, GONE_TEXT[reason].format(ttl=self.ttl_s))
        if entry.owner != caller:
            raise NotOwner("the handle belongs to another caller")
        if touch:
            entry.last_used = self.clock()
            self._entries.move_to_end(token)
        return entry

    def drop(self, token: bytes, reason: str = "HANDLE_NOT_FOUND") -> None:
        self._remove(token, reason)

    def sweep(self) -> None:
        """Expire idle handles past their TTL."""
        deadline = self.clock() - self.ttl_s
        for token in [t for t, e in self._entries.items() if not e.active and e.last_used < deadline]:
            self._remove(token, "HANDLE_EXPIRED")

    def _evict(self, nbytes: int, count: bool = False) -> bool:
        """Evict least-recently-used idle handles until `nbytes` more fit the budget (or, with
        count, until one more handle fits max_handles). False when it cannot be made to fit."""
        def fits():
            return (len(self._entries) < self.max_handles if count
                    else self.nbytes + nbytes <= self.budget_bytes)
        for token in [t for t, e in self._entries.items() if not e.active]:
            if fits():
                break
            self._remove(token, "HANDLE_EVICTED")
        return fits()

    def _remove(self, token: bytes, reason: str) -> None:
        entry = self._entries.pop(token)
        self.nbytes -= entry.nbytes
        self._tombstones[token] = reason
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)
        self._free(entry.handle)
