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
after them, with their entries as its past. After the prefill the prompt's
full blocks that were not cached are stored (:meth:`PrefixCache.store`),
copied out of the step's arrays, so the next prompt with the same opening
finds them.

Each block counts the prefills using it now (``refs``); a block in use, or
the parent of a cached block, is never evicted. The rest are evicted least
recently used first when room is needed: room within the model's
``max_cache_bytes``, which the cached blocks share with the running
sequences' reservations (``generate_scheduler``: admitting a sequence evicts
blocks before it refuses one; a block is stored only where it fits).

The entries themselves are the step's (:class:`BlockEntries`: whatever its
``extract`` returns, ONNX Runtime arrays for ``generate``); this module keeps
only keys, order, counts and sizes. Everything runs on the event loop thread.

Its figures (:class:`PrefixStats`): tokens looked up and tokens found (the
hit rate, as vLLM counts it), requests with a hit, blocks and bytes cached,
blocks evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_TOKENS = 16

#: What a step keeps of one block: its entries for the block's positions (opaque here).
BlockEntries = object


@dataclass(eq=False, slots=True)
class CachedBlock:
    """One block of a cached prefix: its key, its ids, its entries and who needs it."""

    key: bytes
    tokens: tuple[int, ...]
    parent: CachedBlock | None
    entries: BlockEntries
    refs: int = 0  # prefills using it now
    children: int = 0  # cached blocks whose parent it is


@dataclass(frozen=True, slots=True)
class PrefixStats:
    queried_tokens: int  # prompt tokens looked up
    hit_tokens: int  # of those, found cached
    queries: int  # prompts looked up
    hits: int  # of those, with at least one cached block
    blocks: int  # cached now
    bytes: int  # what the cached blocks take
    evicted_blocks: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A prompt's cached opening: its blocks (in order, each held until :meth:`PrefixCache.release`)."""

    blocks: tuple[CachedBlock, ...]
    block_tokens: int

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block_tokens

    @property
    def entries(self) -> list[BlockEntries]:
        return [b.entries for b in self.blocks]


NO_MATCH = PrefixMatch((), DEFAULT_BLOCK_TOKENS)


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
        self._queried = self._hit_tokens = self._queries = self._hits = self._evicted = 0

    @property
    def bytes(self) -> int:
        return len(self._blocks) * self.block_bytes

    def stats(self) -> PrefixStats:
        return PrefixStats(self._queried, self._hit_tokens, self._queries, self._hits, len(self._blocks), self.bytes,
                           self._evicted)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest run of cached blocks ``tokens`` opens with, leaving at least its last token to
        compute; each block is held (not evicted) until released."""
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
        for block in found:
            block.refs += 1
            self._blocks.move_to_end(block.key)  # root first: a parent is older than its children
        self._queries += 1
        self._queried += len(tokens)
        if found:
            self._hits += 1
            self._hit_tokens += len(found) * size
        return PrefixMatch(tuple(found), size)

    def release(self, match: PrefixMatch) -> None:
        for block in match.blocks:
            block.refs -= 1

    def store(self, tokens: Sequence[int], match: PrefixMatch, extract: Callable[[int, int], BlockEntries],
              room: Callable[[int], bool]) -> int:
        """Cache ``tokens``' full blocks after ``match``'s (their entries from ``extract(start, stop)``,
        positions of the prefill just run), each where ``room(block_bytes)`` says it fits once
        unused blocks are evicted; returns the blocks added. Stops at the first that does not fit."""
        size = self.block_tokens
        parent = match.blocks[-1] if match.blocks else None
        key = parent.key if parent is not None else b""
        held: list[CachedBlock] = []  # the chain so far, kept from eviction while it grows
        added = 0
        try:
            for start in range(len(match.blocks) * size, len(tokens) - size + 1, size):
                ids = tuple(tokens[start:start + size])
                key = _key(key, ids)
                block = self._blocks.get(key)
                if block is None or block.tokens != ids:
                    if block is not None:  # a key collision: keep the one there, cache no further
                        break
                    if not self._make_room(room):
                        break
                    block = CachedBlock(key, ids, parent, extract(start, start + size))
                    self._blocks[key] = block
                    if parent is not None:
                        parent.children += 1
                    added += 1
                else:
                    self._blocks.move_to_end(key)
                block.refs += 1
                held.append(block)
                parent = block
        finally:
            for block in held:
                block.refs -= 1
        return added

    def _make_room(self, room: Callable[[int], bool]) -> bool:
        while not room(self.block_bytes):
            if not self.evict(1):
                return False
        return True

    def evict(self, blocks: int) -> int:
        """Drop up to ``blocks`` unused leaf blocks, least recently used first; returns how many went."""
        victims: list[CachedBlock] = []
        for block in self._blocks.values():
            if len(victims) >= blocks:
                break
            if block.refs == 0 and block.children == 0:
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
        self._blocks.clear()
