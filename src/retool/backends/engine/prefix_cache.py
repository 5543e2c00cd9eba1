"""Automatic prefix caching for the local sampler: KV tensors of finished sequences, found by token prefix.

A request whose prompt starts with a sequence the sampler has already run (the group's shared prompt, the
previous turn of the same trajectory, a system prompt seen before) prefills only its new tokens. The
design follows vLLM's automatic prefix caching: a sequence's tokens are cut into blocks of ``block``
tokens and each block gets a key that hashes the block together with the key of the block before it, so
one key stands for a whole prefix. An index maps each key to the entries holding that prefix; a lookup
takes the longest prefix whose key is indexed, checks the tokens (a hash collision serves nothing) and
then extends the match token by token within the entry found.

Each entry holds the keys and values of every layer for its tokens (``[heads, length, head_dim]``),
so entries that share a prefix hold copies of it: simpler than shared blocks, and the memory cap counts
every byte. An entry whose tokens are a prefix of a newly stored one is dropped (the new one serves
every request the old one could). Least recently used entries are evicted beyond ``max_bytes``.

Namespaces: ``space`` (default ``None``) keeps apart entries whose KV came from different weights that
share one cache (the LoRA adapters of one shared-base engine, ``retool.backends.samplers.multi_lora``): a lookup
only ever finds entries stored under its own space.

Validity: KV computed with old weights must never serve a request after the weights change. The owner
passes a tag (weights version, model identity) to ``validate`` before each use; a different tag
empties the cache.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

# Per layer (keys, values), each [kv_heads, length, head_dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Entry:
    tokens: tuple[int, ...]  # the tokens whose KV is held (len == KV length)
    kv: KV
    nbytes: int
    keys: list[int]  # block keys this entry is indexed under
    space: Hashable = None  # whose weights computed the KV (see the module docstring)


@dataclass
class PrefixCacheStats:
    """Counters since the cache was built (clears included)."""

    lookups: int = 0
    hits: int = 0  # lookups that found a prefix
    hit_tokens: int = 0  # tokens served from the cache
    stored: int = 0
    evicted: int = 0
    invalidated: int = 0  # entries dropped because the weights changed


class PrefixCache:
    """LRU map from token prefixes to KV tensors under a byte budget (see the module docstring)."""

    def __init__(self, max_bytes: int, block: int = 16) -> None:
        if max_bytes < 0 or block < 1:
            raise ValueError(f"bad prefix cache size {max_bytes} bytes / block {block}")
        self.max_bytes = int(max_bytes)
        self.block = int(block)
        self.bytes = 0
        self.stats = PrefixCacheStats()
        self._tag: Hashable = None
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._index: dict[int, dict[int, None]] = {}  # block key -> ids of entries holding that prefix
        self._by_last_key: dict[int, set[int]] = {}  # key of an entry's last full block -> entry ids
        self._next_id = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def validate(self, tag: Hashable) -> None:
        """Empty the cache unless ``tag`` (the weights' identity) is the one its entries were made with."""
        if tag != self._tag:
            self.stats.invalidated += len(self._entries)
            self.clear()
            self._tag = tag

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._by_last_key.clear()
        self.bytes = 0

    def _block_keys(self, tokens: Sequence[int], limit: int, space: Hashable = None) -> list[int]:
        keys: list[int] = []
        prev = 0 if space is None else hash(("space", space))
        for end in range(self.block, limit + 1, self.block):
            prev = hash((prev, tuple(tokens[end - self.block : end])))
            keys.append(prev)
        return keys

    def lookup(self, tokens: Sequence[int], limit: int, space: Hashable = None) -> tuple[int, KV | None]:
        """The longest cached prefix of ``tokens[:limit]`` stored under ``space``: (its length, per-layer
        KV views), or (0, None)."""
        self.stats.lookups += 1
        if not self._entries:
            return 0, None
        keys = self._block_keys(tokens, min(limit, len(tokens)), space)
        for k in range(len(keys) - 1, -1, -1):
            ids = self._index.get(keys[k])
            if ids:
                entry_id = next(reversed(ids))
                break
        else:
            return 0, None
        entry = self._entries[entry_id]
        n = (k + 1) * self.block
        if entry.space != space or entry.tokens[:n] != tuple(tokens[:n]):  # a hash collision: serve nothing
            return 0, None
        end = min(len(entry.tokens), limit, len(tokens))
        while n < end and entry.tokens[n] == tokens[n]:
            n += 1
        self._entries.move_to_end(entry_id)
        self.stats.hits += 1
        self.stats.hit_tokens += n
        return n, [(k_[:, :n], v_[:, :n]) for k_, v_ in entry.kv]

    def store(self, tokens: Sequence[int], kv: KV, space: Hashable = None) -> bool:
        """Keep ``kv`` (the KV of exactly ``tokens``, computed by ``space``'s weights) for later lookups;
        False when it cannot fit."""
        if not self.enabled or len(tokens) < self.block:
            return False
        length = len(tokens)
        if any(k.shape[1] != length or v.shape[1] != length for k, v in kv):
            raise ValueError(f"KV length does not match the {length} tokens stored")
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.max_bytes:
            return False
        seq = tuple(int(t) for t in tokens)
        keys = self._block_keys(seq, length, space)
        for key in keys:  # entries the new one extends serve nothing it does not
            for old in list(self._by_last_key.get(key, ())):
                held = self._entries[old].tokens
                if self._entries[old].space == space and len(held) <= length and seq[: len(held)] == held:
                    self._remove(old)
        while self._entries and self.bytes + nbytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evicted += 1
        entry_id = self._next_id
        self._next_id += 1
        self._entries[entry_id] = _Entry(seq, kv, nbytes, keys, space)
        for key in keys:
            self._index.setdefault(key, {})[entry_id] = None
        self._by_last_key.setdefault(keys[-1], set()).add(entry_id)
        self.bytes += nbytes
        self.stats.stored += 1
        return True

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        self.bytes -= entry.nbytes
        for key in entry.keys:
            ids = self._index.get(key)
            if ids is not None:
                ids.pop(entry_id, None)
                if not ids:
                    del self._index[key]
        last = self._by_last_key.get(entry.keys[-1])
        if last is not None:
            last.discard(entry_id)
            if not last:
                del self._by_last_key[entry.keys[-1]]
