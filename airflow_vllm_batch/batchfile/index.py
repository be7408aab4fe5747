"""A compact index of custom_ids: 64-bit hashes and line numbers, not the strings.

A Python ``set`` of a million custom_id strings costs around 100 MB, and any
structure probed at random per line (a set, a large bitmap, thousands of small
buckets) misses the CPU caches on every line, which at a few hundred thousand
lines per second is most of the time budget. So the streaming pass only
*appends*: each custom_id's hash and line number go to one of 64 partitions
(``array`` buffers, 12 bytes per line, whose ends stay in cache). The
comparisons happen once, at the end, one partition at a time (a dict of about
n/64 entries), so memory stays flat apart from those 12 bytes per line.

The hash is Python's ``hash(str)`` (SipHash, 64-bit on the platforms Airflow
runs on), salted per process; an index lives within one process, so the salt
does not matter. Two *different* custom_ids share a hash with probability about
n²/2⁶⁵ (3·10⁻⁸ for a million lines). The checks can confirm the listed
findings exactly with a second pass over the file (they read only the lines
named), which also recovers the custom_id strings for the messages.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

#: 64 partitions: their 128 array tails stay in cache while streaming, and the
#: end-of-stream dict of one partition holds ~n/64 entries.
PARTITION_BITS = 6
#: Line numbers as 32-bit ints (2³¹ lines is a 500 GB file): 12 bytes per line with the hash.
LINE_TYPECODE = "i"


class CustomIdIndex:
    """
    Hashes of custom_ids with the line each was seen on, appended while streaming.

    :param partition_bits: log2 of the number of partitions. Default 6.
    """

    __slots__ = ("_sorted", "hashes", "lines", "mask")

    def __init__(self, partition_bits: int = PARTITION_BITS) -> None:
        self.mask = (1 << partition_bits) - 1
        self.hashes: list[array[int]] = [array("q") for _ in range(self.mask + 1)]
        self.lines: list[array[int]] = [array(LINE_TYPECODE) for _ in range(self.mask + 1)]
        # Per partition, (hashes, lines) sorted by hash, made by line_of() on first use.
        self._sorted: list[tuple[array[int], array[int]] | None] = [None] * (self.mask + 1)

    def __len__(self) -> int:
        return sum(len(hs) for hs in self.hashes)

    def add(self, custom_id: str, line: int) -> None:
        """
        Record ``custom_id`` as seen on ``line`` (hot loops inline this; keep them in step).

        :param custom_id: the custom_id.
        :param line: its 1-based line number.
        """
        h = hash(custom_id)
        p = h & self.mask
        self.hashes[p].append(h)
        self.lines[p].append(line)

    def line_of(self, custom_id: str) -> int | None:
        """
        Return the first line ``custom_id`` was seen on, or ``None``; for look-ups once the index is complete.

        The first look-up in a partition sorts it (a copy of ~1/64 of the index,
        kept for later look-ups), so a few look-ups cost little and even one per
        line stays at 12 more bytes per line.

        :param custom_id: the custom_id to find.
        """
        h = hash(custom_id)
        p = h & self.mask
        part = self._sorted[p]
        if part is None:
            hs, ls = self.hashes[p], self.lines[p]
            # A stable sort keeps equal hashes in line order: bisect finds the first line.
            order = sorted(range(len(hs)), key=hs.__getitem__)
            part = self._sorted[p] = (
                array("q", map(hs.__getitem__, order)),
                array(LINE_TYPECODE, map(ls.__getitem__, order)),
            )
        hashes, lines = part
        i = bisect_left(hashes, h)
        return lines[i] if i < len(hashes) and hashes[i] == h else None

    def found_in(self, other: CustomIdIndex) -> int:
        """
        Return how many distinct custom_ids of this index ``other`` holds too.

        A custom_id ``other`` holds twice counts once, and one only ``other`` holds counts
        nothing: with this index the input's and ``other`` the checkpoints' answers, the
        requests answered already (not the answers, which two tries may have repeated).

        :param other: an index built with the same number of partitions, in the same process.
        """
        if other.mask != self.mask:
            raise ValueError("indexes must have the same number of partitions")
        return sum(len(set(hs).intersection(theirs)) for hs, theirs in zip(self.hashes, other.hashes))

    def repeats(self) -> Iterator[tuple[int, int]]:
        """Yield ``(line, first_line)`` for every entry whose id was already seen on ``first_line``; not in line order."""
        for p, hs in enumerate(self.hashes):
            # A set built in C answers "no repeats here" for most partitions.
            if len(set(hs)) == len(hs):
                continue
            first: dict[int, int] = {}
            for h, line in zip(hs, self.lines[p]):
                seen = first.setdefault(h, line)
                if seen != line:
                    yield line, seen

    def match(self, other: CustomIdIndex) -> Iterator[tuple[str, int, int]]:
        """
        Compare this index (e.g. the input's) with ``other`` (e.g. the results').

        Yield ``("missing", line, 0)`` for each id of this index never in ``other``,
        ``("extra", other_line, 0)`` for each entry of ``other`` not in this index,
        and ``("repeat", other_line, first_other_line)`` for each entry of ``other``
        repeating an id already matched. Not in line order.

        :param other: an index built with the same number of partitions, in the same process.
        """
        if other.mask != self.mask:
            raise ValueError("indexes must have the same number of partitions")
        for p, hs in enumerate(self.hashes):
            wanted: dict[int, int] = {}
            for h, line in zip(hs, self.lines[p]):
                wanted.setdefault(h, line)
            answered: dict[int, int] = {}
            for h, line in zip(other.hashes[p], other.lines[p]):
                if h not in wanted:
                    yield "extra", line, 0
                    continue
                first = answered.setdefault(h, line)
                if first != line:
                    yield "repeat", line, first
            for h, line in wanted.items():
                if h not in answered:
                    yield "missing", line, 0

    def memory_bytes(self) -> int:
        """Return the bytes held by the index's buffers (for benchmarks and logs)."""
        return sum(a.buffer_info()[1] * a.itemsize for a in self.hashes + self.lines)


class FirstN:
    """
    Count items and keep the ``limit`` smallest, in bounded memory.

    :param limit: how many to keep.
    """

    __slots__ = ("_heap", "count", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self._heap: list[
            tuple[Any, tuple[Any, ...]]
        ] = []  # max-heap by negated key, holding the smallest items

    def add(self, item: tuple[Any, ...]) -> None:
        """Count ``item`` and keep it if it is among the ``limit`` smallest so far."""
        self.count += 1
        if self.limit <= 0:
            return
        entry = (-item[0], item)
        if len(self._heap) < self.limit:
            heapq.heappush(self._heap, entry)
        elif entry > self._heap[0]:
            heapq.heapreplace(self._heap, entry)

    def items(self) -> list[tuple[Any, ...]]:
        """Return the kept items, sorted."""
        return sorted(entry[1] for entry in self._heap)


def hash_partitions(partition_bits: int = PARTITION_BITS) -> list[array[int]]:
    """
    Return empty partitions for bare hashes (no line numbers): the cheapest record a hot loop can keep.

    Append ``h`` to ``parts[h & (len(parts) - 1)]``; find repeats afterwards with
    :func:`repeated_hashes` and locate them with a second pass.

    :param partition_bits: log2 of the number of partitions. Default 6.
    """
    return [array("q") for _ in range(1 << partition_bits)]


def repeated_hashes(parts: list[array[int]]) -> dict[int, int]:
    """
    Return ``{hash: times seen}`` for every hash seen more than once, one partition at a time.

    :param parts: partitions filled as :func:`hash_partitions` describes.
    """
    found: dict[int, int] = {}
    for hs in parts:
        if len(set(hs)) == len(hs):
            continue
        counts: dict[int, int] = {}
        for h in hs:
            counts[h] = counts.get(h, 0) + 1
        found.update((h, n) for h, n in counts.items() if n > 1)
    return found
