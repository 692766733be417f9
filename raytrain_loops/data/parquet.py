"""Parquet splits read in the epoch's order, without Ray: which rows each worker reads, in what
order, and how.

An epoch's order is a function of (``loop.seed``, epoch, group size) over the whole split, defined
on the split's files, row groups and row offsets (never on Ray Data's blocks, whose boundaries
are not stable):

1. the split is cut into *chunks*: every row group into pieces of at most ``data.shuffle_chunk_rows``
   rows, in storage order;
2. the chunks are dealt out with a generator seeded by (seed, epoch)
   (:func:`~raytrain_loops.data.deal.deal`, on one number per chunk; a worker builds its own
   share's pieces only, so neither a plan's time nor its memory is the split's list): of every
   ``world`` neighbouring chunks each worker gets one, at random, and takes its chunks in random
   order. A new order of the whole split every epoch, the same on every run; a worker reads
   ``1 / world`` of the chunks, from every region of the split, and a different set every epoch;
3. the dealt rows are cut into equal contiguous shares, worker ``r`` taking rows
   ``[r * share, (r + 1) * share)`` (the remainder is dropped, as
   :func:`~raytrain_loops.engine.length.batches_per_epoch` counts);
4. the share is read in *windows* of about ``data.shuffle_buffer`` rows (whole chunks), whose
   rows are permuted by a generator seeded by (seed, epoch, world, rank, window): neighbouring
   rows of the files end up in different batches.

A position in the epoch is a row offset in the worker's share, so a resumed epoch opens the
window holding it and reads nothing before that window (the window's own rows before the
position are read again: its order is a permutation of all of them). A group of another size
finishes an epoch on the rows its predecessor had not trained, re-cut over it and read from these
plans' windows (:mod:`raytrain_loops.data.recut`). Evaluation splits are read in storage order,
each worker taking ``rows * r // world`` to ``rows * (r + 1) // world``.

Random draws of :meth:`Task.preprocess <raytrain_loops.tasks.Task.preprocess>` take their seeds
from :data:`ROW_SEED`: one per row, a hash of (seed, epoch, file, row group, offset), so the same
row gets the same augmentation in an epoch whatever the group size or a resume.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from raytrain_loops.data.deal import FILE, GROUP, START, STOP, cut, keyed_rng, shares, storage_span
from raytrain_loops.streams import close

ROW_SEED = "_row_seed"
"""The batch key under which :meth:`Task.preprocess` finds each row's seed (``uint64``)."""


@dataclass
class SplitIndex:
    """Where a Parquet split's rows are: its files (in the dataset's order) on ``filesystem``,
    the rows of each row group, and the columns a task reads. Built from the files' footers
    (:func:`index_split`); small enough to send to every worker."""

    path: str
    filesystem: Any
    files: list[str]
    row_groups: list[list[int]]
    columns: list[str]
    memory_bytes: int = 0
    """The columns' size in memory, estimated from the footers
    (:func:`~raytrain_loops.data.footprint.memory_bytes`)."""
    table: Any = field(default=None, repr=False)
    """The split's columns held in memory (a ``pyarrow.Table`` or a Ray object reference to one),
    read instead of the files when set."""

    @property
    def rows(self) -> int:
        return int(sum(sum(groups) for groups in self.row_groups))

    def group_offsets(self) -> dict[tuple[int, int], int]:
        """The first row of every (file, row group) in the split's storage order."""
        offsets, at = {}, 0
        for f, groups in enumerate(self.row_groups):
            for g, n in enumerate(groups):
                offsets[(f, g)] = at
                at += n
        return offsets

    def largest_group(self) -> int:
        return max((n for groups in self.row_groups for n in groups), default=0)

    def read_all(self) -> Any:
        """The split's columns as one ``pyarrow.Table``, in the index's file order (the order
        :meth:`group_offsets` counts in)."""
        import pyarrow.dataset as pads

        return pads.dataset(self.files, filesystem=self.filesystem, format="parquet").to_table(columns=self.columns)


def index_split(path: str, columns: list[str], ds: Any = None) -> SplitIndex:
    """The :class:`SplitIndex` of the Parquet file or directory (or URI) ``path``; ``ds``: its
    ``pyarrow.dataset`` when the caller has already opened it (no second listing)."""
    import pyarrow.dataset as pads

    from raytrain_loops.data.footprint import memory_bytes

    ds = ds if ds is not None else pads.dataset(path, format="parquet")
    groups, size = [], 0
    for fragment in ds.get_fragments():
        meta = fragment.metadata
        groups.append([meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
        size += memory_bytes(meta, columns)
    return SplitIndex(path, ds.filesystem, list(ds.files), groups, list(columns), size)


@dataclass
class WorkerPlan:
    """One worker's rows of one epoch: ``pieces`` in reading order, read in windows of whole
    pieces (a window starts at the first piece that begins past a multiple of ``window`` rows);
    with ``key`` (seed, epoch, world, rank) each window's rows are permuted."""

    pieces: np.ndarray
    window: int
    key: tuple[int, ...] | None

    def __post_init__(self) -> None:
        lengths = self.pieces[:, STOP] - self.pieces[:, START]
        begins = np.cumsum(lengths) - lengths
        ids = begins // self.window
        # Piece index where each window starts, and the row where it starts; then the ends.
        firsts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.zeros(0, dtype=np.int64)
        self._bounds = np.r_[firsts, len(ids)]
        self._starts = np.r_[begins[firsts], lengths.sum()] if len(ids) else np.zeros(1, dtype=np.int64)

    @property
    def rows(self) -> int:
        return int(self._starts[-1])

    @property
    def windows(self) -> int:
        return len(self._bounds) - 1

    @property
    def window_rows(self) -> np.ndarray:
        """The rows of each window."""
        return np.diff(self._starts)

    def window_pieces(self, w: int) -> np.ndarray:
        return self.pieces[self._bounds[w] : self._bounds[w + 1]]

    def locate(self, row: int) -> tuple[int, int]:
        """The window holding row ``row`` of the share, and the row's offset in it (past the end:
        ``(windows, 0)``)."""
        if row >= self.rows:
            return self.windows, 0
        w = int(np.searchsorted(self._starts, row, side="right")) - 1
        return w, row - int(self._starts[w])

    def order(self, w: int, n: int) -> np.ndarray | None:
        """The permutation of window ``w``'s ``n`` rows (None: storage order)."""
        return None if self.key is None else keyed_rng(*self.key, w).permutation(n)


# Rows per window when the train split is not shuffled (data.shuffle_buffer=0) and for evaluation.
READ_ROWS = 4096


def train_plan(
    index: SplitIndex, seed: int, epoch: int, world: int, rank: int, chunk_rows: int, buffer: int
) -> WorkerPlan:
    """Worker ``rank``'s share of the training split in ``epoch``: the split's chunks dealt out
    by (seed, epoch) (:func:`~raytrain_loops.data.deal.deal`), the dealt order cut into
    ``world`` equal shares (the remainder dropped); windows of about ``buffer`` rows permuted
    (``buffer`` 0: storage order, no shuffle at all). Only this share's pieces are built."""
    (mine,) = shares(index.row_groups, (seed, epoch), world, chunk_rows, bool(buffer), [rank])
    return WorkerPlan(mine, buffer or READ_ROWS, (seed, epoch, world, rank) if buffer else None)


def eval_plan(index: SplitIndex, world: int, rank: int) -> WorkerPlan:
    """Worker ``rank``'s part of an evaluation split: rows ``rows * rank // world`` to
    ``rows * (rank + 1) // world`` in storage order (every row evaluated once)."""
    n = index.rows
    mine = storage_span(index.row_groups, READ_ROWS, n * rank // world, n * (rank + 1) // world)
    return WorkerPlan(mine, READ_ROWS, None)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def row_seeds(seed: int, epoch: int, pieces: np.ndarray) -> np.ndarray:
    """One ``uint64`` seed per row of ``pieces`` (in their order), a hash of (seed, epoch, file,
    row group, row offset): the row's own, whichever worker reads it and from where."""
    lengths = pieces[:, STOP] - pieces[:, START]
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    offsets += np.repeat(pieces[:, START], lengths)
    h = _mix(np.full(len(offsets), seed % 2**64, dtype=np.uint64))
    for part in (
        np.full(len(offsets), epoch, dtype=np.int64),
        np.repeat(pieces[:, FILE], lengths),
        np.repeat(pieces[:, GROUP], lengths),
        offsets,
    ):
        h = _mix(h ^ part.astype(np.uint64))
    return h


READ_ATTEMPTS = 6
"""Attempts at reading a row group whose store answers with a transient error (beyond pyarrow's own
retries of each request)."""

RETRY_BASE_S = 0.25
"""The first wait before a read is tried again; it doubles at each attempt, with jitter."""

TRANSIENT = (
    "SLOW_DOWN",
    "SlowDown",
    "HTTP status 503",
    "HTTP status 500",
    "SERVICE_UNAVAILABLE",
    "INTERNAL_FAILURE",
    "NETWORK_CONNECTION",
    "Connection reset",
    "connection reset",
    "Broken pipe",
    "timed out",
)
"""What a store's answer says when trying again may succeed: throttling, a 503 or 500, a dropped
connection. Anything else (a missing file, a denied request, a damaged footer) fails at once."""


def transient(err: BaseException) -> bool:
    """Whether ``err`` is a store's answer that a later attempt may not meet."""
    text = str(err)
    return isinstance(err, (ConnectionError, TimeoutError)) or any(t in text for t in TRANSIENT)


class Reader:
    """Reads pieces of a split with pyarrow, each row group at most once per call, from the files
    or from ``index.table`` when the split is held in memory. A transient error of the store is
    tried again with backoff (:data:`READ_ATTEMPTS`); any other, or the last, is an ``OSError``
    naming the file, the row group and the store's answer. ``rows_read`` counts the rows
    pyarrow decoded from the files (whole row groups)."""

    def __init__(self, index: SplitIndex):
        self.index = index
        self.rows_read = 0
        self._files: dict[int, Any] = {}
        self._table = None
        self._offsets: dict[tuple[int, int], int] = {}
        if index.table is not None:
            table = index.table
            if not hasattr(table, "slice"):  # a Ray object reference
                import ray

                table = ray.get(table)
            self._table, self._offsets = table, index.group_offsets()

    def _group(self, f: int, g: int) -> Any:
        if self._table is not None:
            return self._table.slice(self._offsets[(f, g)], self.index.row_groups[f][g])
        path = self.index.files[f]
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                group = self._read_group(f, g)
                break
            except Exception as err:  # pyarrow's errors do not always say which file
                handle = self._files.pop(f, None)  # opened afresh on the next attempt
                if handle is not None:
                    handle.close()
                if not transient(err) or attempt == READ_ATTEMPTS:
                    tries = f" after {attempt} attempts" if attempt > 1 else ""
                    raise OSError(f"reading row group {g} of {path}{tries}: {err}") from err
                time.sleep(RETRY_BASE_S * 2 ** (attempt - 1) * (1 + random.random()))
        self.rows_read += group.num_rows
        return group

    def _read_group(self, f: int, g: int) -> Any:
        import pyarrow.parquet as pq

        if f not in self._files:
            if len(self._files) >= 8:
                self._files.pop(next(iter(self._files))).close()
            self._files[f] = pq.ParquetFile(self.index.filesystem.open_input_file(self.index.files[f]))
        # One thread: the read-ahead thread already overlaps it with the step, and Arrow's
        # pool would take CPUs from the step's own threads.
        return self._files[f].read_row_group(g, columns=self.index.columns, use_threads=False)

    def read(self, pieces: np.ndarray) -> dict[str, np.ndarray]:
        """The rows of ``pieces`` in the pieces' order, as column name -> NumPy array (lists and
        binaries: object arrays, whose rows a permutation then moves without copying them).
        Each row group is converted on its own: NumPy's conversion of one long chunked column
        is about 4 times slower than of its row groups one by one."""
        groups: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        parts = []
        for f, g, start, stop in pieces.tolist():
            if (f, g) not in groups:
                table = self._group(f, g)
                groups[(f, g)] = {name: table.column(name).to_numpy() for name in self.index.columns}
            parts.append({name: column[start:stop] for name, column in groups[(f, g)].items()})
        if not parts:
            return {c: np.zeros(0) for c in self.index.columns}
        return {name: np.concatenate([p[name] for p in parts]) for name in self.index.columns}

    def close(self) -> None:
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def read_window(
    reader: Reader, plan: WorkerPlan, w: int, skip: int = 0, seeds: tuple[int, int] | None = None
) -> dict[str, np.ndarray]:
    """Window ``w`` of ``plan`` in its order, leaving out its first ``skip`` rows; with
    ``seeds`` (seed, epoch), the rows' :data:`ROW_SEED` column too. A plan of another kind (a
    re-cut share, :class:`~raytrain_loops.data.recut.RecutPlan`) reads its own windows."""
    if not isinstance(plan, WorkerPlan):
        return plan.read(reader, w, skip, seeds)
    pieces = plan.window_pieces(w)
    if plan.key is None:  # storage order: the rows before the position are not read at all
        pieces = cut(pieces, skip, plan.window + plan.rows)
        skip = 0
    batch = reader.read(pieces)
    if seeds is not None:
        batch[ROW_SEED] = row_seeds(*seeds, pieces)
    n = len(next(iter(batch.values())))
    order = plan.order(w, n)
    pick = order[skip:] if order is not None else slice(skip, None)
    return {k: v[pick] for k, v in batch.items()}


def windows_from(
    reader: Reader, plan: WorkerPlan, start_row: int, seeds: tuple[int, int] | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """The plan's rows from row ``start_row`` of the share on, a window at a time: a resumed
    epoch reads nothing before the window holding its position."""
    first, skip = plan.locate(start_row)
    for w in range(first, plan.windows):
        yield read_window(reader, plan, w, skip if w == first else 0, seeds)


def sliced(fetched: Iterable[dict[str, Any]], size: int, collate, drop_last: bool) -> Iterable[Any]:
    """Cut NumPy batches into batches of ``size`` rows, each passed through ``collate``; rows
    left over at the end of one fetched batch are joined with the next."""
    rest: dict[str, Any] | None = None
    try:
        for batch in fetched:
            if rest is not None:
                batch = {k: np.concatenate([rest[k], v]) for k, v in batch.items()}
                rest = None
            n = len(next(iter(batch.values())))
            start = 0
            while n - start >= size:
                yield collate({k: v[start : start + size] for k, v in batch.items()})
                start += size
            if start < n:
                rest = {k: v[start:] for k, v in batch.items()}
        if rest is not None and not drop_last:
            yield collate(rest)
    finally:
        close(fetched)  # this stream closed (its epoch ended, whatever the reason): so is what it reads


CLOSE_S = 2.0
"""The longest a stream made on a thread (:func:`prefetched`) waits, when it is closed, for that
thread to end; a thread still busy then (a window's read from a slow store, a Dataset's next batch
that does not come) ends on its own, making nothing more and closing what it reads."""


def prefetched(
    items: Iterable[Any],
    depth: int,
    name: str = "parquet-prefetch",
    *,
    waiting: threading.Event | None = None,
    interrupt: Callable[[], None] | None = None,
) -> Iterator[Any]:
    """``items`` produced on a background thread (``name``), at most ``depth`` ahead (0: in the
    caller's thread). pyarrow reads and decodes without holding the GIL, so the step runs
    meanwhile. An error in the thread is raised in the caller. ``waiting`` is set while the caller
    waits for an item (what the thread waits for may bound the caller's waits by it);
    ``interrupt`` is called when the caller closes the stream while the thread still works (to end
    what it waits for), and the close then waits for the thread at most :data:`CLOSE_S`."""
    if depth <= 0:
        yield from items
        return
    done = object()
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def fill() -> None:
        ended = False
        try:
            for item in items:
                _put(q, item, stop)
                if stop.is_set():  # closed, while this waited for room or before: nothing more is made
                    return
            ended = True
            close(items)  # before the end is handed over: an error closing is the caller's too
            _put(q, done, stop)
        except BaseException as err:  # handed to the consumer, raised there
            _put(q, err, stop)
        finally:
            if not ended:
                close(items)  # its open files, in this thread that iterated it

    if waiting is not None:
        waiting.clear()  # the caller is not waiting yet
    thread = threading.Thread(target=fill, name=name, daemon=True)
    thread.start()
    try:
        while (item := _take(q, waiting)) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        if interrupt is not None and thread.is_alive():
            interrupt()
        deadline = time.monotonic() + CLOSE_S
        while thread.is_alive() and time.monotonic() < deadline:  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.05)


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    """``item`` put in ``q`` once it has room, unless ``stop`` is set first: a thread that outlived
    its caller's close never waits for room that no one makes."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _take(q: queue.Queue, waiting: threading.Event | None) -> Any:
    """The next item of ``q``, ``waiting`` set while it is waited for."""
    if waiting is None:
        return q.get()
    waiting.set()
    try:
        return q.get()
    finally:
        waiting.clear()
