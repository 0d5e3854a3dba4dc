"""A generation instance's prefix cache: the KV entries of whole blocks of
prompts served before, kept so that a prompt opening with them prefills only
the rest (vLLM's automatic prefix caching, on this worker's cache layout).

A prompt (its token ids, with the ids of a resumed generation after it) is
cut into blocks of ``block_tokens`` ids. Block ``i``'s key is a hash of the
key of block ``i - 1`` and its own ids, so a key names the whole prefix up to
its block's end: two prompts share a cached block only where they agree on
every token before it. A request looks its prompt up before its prefill
(:meth:`PrefixCache.match`): the longest run of cached blocks from the start,
at most all but the prompt's last token (the prefill must compute at least
one position, whose logits choose the first token). Its prefill then starts
after them, with their entries as its past.

A block's entries live either in the cache's own copy or in the caches of
the running sequences whose positions they are (its *holders*), never in
both. After a prefill its prompt's full blocks go to its sequence
(:meth:`PrefixCache.hold`): those not cached yet are added without a copy,
and a cached block it read drops the cache's copy, since the sequence's own
cache holds the same positions for as long as it runs. A prompt that opens
with a held block reads its entries out of a holder's cache. When a holder
ends, the blocks no other running sequence holds are copied out of its
cache into the cache's own (:meth:`PrefixCache.hand_back`), into the room
its reservation leaves (it held at least their positions). So a running
sequence's prefix takes its room once, as in a paged cache, where a
sequence's blocks are the cached ones; unlike one, two sequences running on
the same opening each hold a copy (a step's past is one contiguous array
per row), each inside its own reservation.

Each block counts the prefills using it now (``refs``); a block in use, a
held block, or the parent of a cached block, is never evicted. The rest are
evicted least recently used first when room is needed: room within the
model's ``max_cache_bytes``, which the cache's own copies share with the
running sequences' reservations (``generate_scheduler``: admitting a
sequence evicts blocks before it refuses one).

The entries themselves are the step's (:class:`BlockEntries`: whatever its
``extract`` returns, ONNX Runtime arrays for ``generate``); this module keeps
only keys, order, counts, holders and sizes. Everything runs on the event
loop thread.

Its figures (:class:`PrefixStats`): tokens looked up and tokens found (the
hit rate, as vLLM counts it), requests with a hit, blocks cached (held ones
among them) and the bytes of the cache's own copies, blocks evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

DEFAULT_BLOCK_TOKENS = 16

#: What a step keeps of one block: its entries for the block's positions (opaque here).
BlockEntries = object
#: A running sequence whose cache holds a block's positions (opaque here; hashable by identity).
Holder = object
#: Positions ``start``..``stop`` of a holder's cache, copied out: ``read(holder, start, stop)``.
ReadHeld = Callable[[Holder, int, int], BlockEntries]


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One block of a cached prefix: its key, its ids, its entries and who needs it."""

    key: bytes
    tokens: tuple[int, ...]
    parent: CachedBlock | None
    start: int  # its first position in the prompt
    entries: BlockEntries | None  # the cache's own copy; None while holders' caches hold them
    holders: list[Holder] = field(default_factory=list)  # running sequences whose caches hold it
    refs: int = 0  # prefills using it now
    children: int = 0  # cached blocks whose parent it is


@dataclass(frozen=True, slots=True)
class PrefixStats:
    queried_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of those, found cached
    queries: int  # prompts looked up
    hits: int  # of those, with at least one cached block
    blocks: int  # cached now
    bytes: int  # what the cache's own copies take (a held block's entries are in its holders' room)
    evicted_blocks: int
    held_blocks: int = 0  # of ``blocks``, those whose entries a running sequence's cache holds


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A prompt's cached opening: its blocks (in order, each kept until :meth:`PrefixCache.release`)
    and their entries (a held block's read out of a holder's cache when it was matched)."""

    blocks: tuple[CachedBlock, ...]
    entries: tuple[BlockEntries, ...]
    block_tokens: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens


NO_MATCH = PrefixMatch((), (), DEFAULT_BLOCK_TOKENS)


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


class PrefixCache:
    """Blocks of prompts served before, by chained key, least recently used first out."""

    def __init__(self, block_tokens: int, block_bytes: int) -> None:
        """``block_bytes``: what one block's entries take (every layer's key and value)."""
        if block_tokens < 1:
            raise ValueError("a prefix cache block holds at least one token")
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()  # least recently used first
        self._held: dict[Holder, list[CachedBlock]] = {}  # each holder's blocks
        self._held_count = 0
        self._queried = self._hit_tokens = self._queries = self._hits = self._evicted = 0

    @property
    def bytes(self) -> int:
        """What the cache's own copies take (held blocks take their holders' room)."""
        return (len(self._blocks) - self._held_count) * self.block_bytes

    def stats(self) -> PrefixStats:
        return PrefixStats(self._queried, self._hit_tokens, self._queries, self._hits, len(self._blocks), self.bytes,
                           self._evicted, self._held_count)

    def match(self, tokens: Sequence[int], read: ReadHeld) -> PrefixMatch:
        """The longest run of cached blocks ``tokens`` opens with, leaving at least its last token to
        compute; each block is kept (not evicted) until released. A held block's entries are
        ``read`` out of a holder's cache."""
        size = self.block_tokens
        found: list[CachedBlock] = []
        key = b""
        for start in range(0, len(tokens) - 1 - size + 1, size):
            ids = tuple(tokens[start:start + size])
            key = _key(key, ids)
            block = self._blocks.get(key)
            if block is None or block.tokens != ids:
                break
            found.append(block)
        entries = tuple(read(b.holders[0], b.start, b.start + size) if b.holders else b.entries for b in found)
        for block in found:
            block.refs += 1
            self._blocks.move_to_end(block.key)  # root first: a parent is older than its children
        self._queries += 1
        self._queried += len(tokens)
        if found:
            self._hits += 1
            self._hit_tokens += len(found) * size
        return PrefixMatch(tuple(found), entries, size)

    def release(self, match: PrefixMatch) -> None:
        for block in match.blocks:
            block.refs -= 1

    def hold(self, tokens: Sequence[int], match: PrefixMatch, holder: Holder) -> int:
        """A prefill of ``tokens`` (after ``match``'s blocks) has run and its sequence goes on: its
        cache now holds every full block of ``tokens``, and it becomes a holder of each. The blocks
        not cached yet are added with no copy (they take the room of its reservation); a block the
        cache held a copy of drops it. Returns the blocks added."""
        size = self.block_tokens
        if any(self._blocks.get(b.key) is not b for b in match.blocks):  # cleared since: held from the root
            match = NO_MATCH
        mine = self._held.setdefault(holder, [])
        for block in match.blocks:
            self._take(block, holder, mine)
        parent = match.blocks[-1] if match.blocks else None
        key = parent.key if parent is not None else b""
        added = 0
        for start in range(len(match.blocks) * size, len(tokens) - size + 1, size):
            ids = tuple(tokens[start:start + size])
            key = _key(key, ids)
            block = self._blocks.get(key)
            if block is None:
                block = CachedBlock(key, ids, parent, start, None)
                self._blocks[key] = block
                if parent is not None:
                    parent.children += 1
                added += 1
            elif block.tokens != ids:  # a key collision: keep the one there, cache no further
                break
            else:
                self._blocks.move_to_end(key)
            self._take(block, holder, mine)
            parent = block
        if not mine:
            del self._held[holder]
        return added

    def _take(self, block: CachedBlock, holder: Holder, mine: list[CachedBlock]) -> None:
        if holder in block.holders:
            return
        if not block.holders:  # its entries are in the holder's cache from now on
            block.entries = None
            self._held_count += 1
        block.holders.append(holder)
        mine.append(block)

    def hand_back(self, holder: Holder, read: ReadHeld) -> int:
        """``holder`` ends: the blocks no other running sequence holds are copied out of its cache
        (``read``) into the cache's own, in the room its reservation leaves (it held at least their
        positions). Returns how many were copied."""
        copied = 0
        for block in self._held.pop(holder, []):
            block.holders.remove(holder)
            if not block.holders:
                block.entries = read(holder, block.start, block.start + self.block_tokens)
                self._held_count -= 1
                copied += 1
        return copied

    def evict(self, blocks: int) -> int:
        """Drop up to ``blocks`` unused leaf blocks, least recently used first; returns how many went."""
        victims: list[CachedBlock] = []
        for block in self._blocks.values():
            if len(victims) >= blocks:
                break
            if block.refs == 0 and block.children == 0 and not block.holders:
                victims.append(block)
        for block in victims:
            del self._blocks[block.key]
            if block.parent is not None:
                block.parent.children -= 1
        self._evicted += len(victims)
        if victims and len(victims) < blocks:  # leaves gone may have made their parents leaves
            return len(victims) + self.evict(blocks - len(victims))
        return len(victims)

    def free_bytes(self, needed: int) -> None:
        """Evict unused blocks until ``needed`` bytes have gone, or none is left to evict."""
        want = -(-needed // self.block_bytes) if self.block_bytes else 0
        if want > 0:
            self.evict(want)

    def clear(self) -> None:
        """Forget every block, held ones too (their holders' caches stay theirs); the counts stay."""
        self._blocks.clear()
        self._held.clear()
        self._held_count = 0
