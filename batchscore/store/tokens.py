"""The token store: a job's prompts tokenized once, on disk, memory-mapped.

A folder (in the run's folder, beside the parts) holding, for every row that can be scored, in
input order (a row's *position* in the store):

    tokens.u16       every prompt's token ids, one flat array: uint16 while every id fits
                     (most vocabularies below 65,536: half the disk and page cache), else
    tokens.i32       int32 (the file widened in place at the first id that does not fit)
    offsets.i64      [N + 1] row position i is tokens[offsets[i]:offsets[i + 1]]
    row_ids.i64      [N] the input row of each position (rows with errors have none)
    option_set.i32   [N] each row's options: an index into the option sets, -1 for none
    option_sets.npz  the distinct option sets (labels, or each row's choices), packed
    errors.jsonl     the rows that cannot be scored: {"row": row id, "error": message}
    head_starts.i64  [N] (only when some row has a head) where each row's head starts in tokens
    head_lengths.i32 [N] its length, 0 for none: row i is its head, then its own span
    manifest.json    counts, the widest token id, and the content identity; written last,
                     so a store without it is incomplete and is rebuilt

What a task's rows share by construction is stored once: rows added as one *group* (a questions
record's reads, which all begin with the record's chat header and state) keep the first row whole
and each later one's common prefix with it as a head, a reference into the first row's tokens, so
only its own remainder is written (plan/sorted_rows.FlatTokens reads both spans). `num_tokens` is
what the file holds; `logical_tokens` what the rows hold.

Writing streams: a batch's rows are appended and forgotten, so building holds no Python object
per row or per token beyond one input batch. Reading maps the arrays: a process's anonymous
memory does not grow with the store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from batchscore.io.atomic import atomic_write, refuse_link
from batchscore.plan.options import OptionTokens
from batchscore.plan.sorted_rows import FlatTokens
from batchscore.plan.types import Request
from batchscore.row_errors import kind_of, typed

log = logging.getLogger("batchscore")

FORMAT = 3  # 2: per-file checksums and the manifest's own digest (store_problem); 3: heads
_FILES = ("tokens.u16", "tokens.i32", "offsets.i64", "row_ids.i64", "option_set.i32", "option_sets.npz", "errors.jsonl",
          "head_starts.i64", "head_lengths.i32", "manifest.json")
MIN_HEAD = 32  # tokens: a group's later row shares less than this with its first and is stored whole
_NARROW, _WIDE = np.dtype("<u2"), np.dtype("<i4")  # the token file's two widths
_TOKEN_FILES = {_NARROW: "tokens.u16", _WIDE: "tokens.i32"}


def identity_digest(identity: dict) -> str:
    """The store's content identity: a digest of what its tokens depend on (input, prompt,
    labels, tokenizer, software), as canonical JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class StoreWriter:
    """Appends batches of rows to a new store in `folder` (anything there before is removed).

    `add_requests` takes a batch's Requests (with `groups`, rows that share a head: see the
    module docstring); `add_flat` takes a batch already flat (arrays); `add_errors` a batch's row
    errors. `close(num_input_rows)` writes the manifest; until then the store is incomplete."""

    def __init__(self, folder, identity: dict | None = None) -> None:
        self.folder = Path(folder)
        refuse_link(self.folder, "the token store's folder")  # never cleared or filled through a link
        if self.folder.exists():
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        self.identity = identity_digest(identity or {})
        self.token_dtype = _NARROW  # widened at the first id past 65,535 (or below 0)
        self._tokens = open(self.folder / _TOKEN_FILES[self.token_dtype], "wb")
        self._offsets = open(self.folder / "offsets.i64", "wb")
        self._row_ids = open(self.folder / "row_ids.i64", "wb")
        self._option_set = open(self.folder / "option_set.i32", "wb")
        self._errors = open(self.folder / "errors.jsonl", "w", encoding="utf-8")
        self._offsets.write(np.zeros(1, np.int64).tobytes())
        self._total = 0
        self.num_rows = 0
        self.num_errors = 0
        self.max_token = 0
        self._sets: dict[tuple[bytes, bytes], int] = {}
        self._set_list: list[OptionTokens] = []
        self._last_row_id = -1
        self._rows_without_options = 0
        self._heads = None  # (head_starts, head_lengths) files, opened at the first head
        self.head_tokens = 0  # tokens rows read from their heads (logical - stored)
        self._group = None  # (group key, its first row's start in tokens, its tokens) of the last group

    def _set_index(self, options: OptionTokens | None) -> int:
        if options is None:
            return -1
        key = options.key()
        index = self._sets.get(key)
        if index is None:
            index = self._sets[key] = len(self._set_list)
            self._set_list.append(options)
        return index

    def add_requests(self, requests: Sequence[Request], groups: Sequence[int] | None = None) -> None:
        """Append a batch of requests (in row id order); their arrays are not kept. With `groups`
        (a key per request), a request of the same group as the one before it stores its common
        prefix with the group's first row (at least MIN_HEAD tokens) as a head, not again; a group
        may go on from the previous call."""
        if not requests:
            return
        row_ids = np.fromiter((r.row_id for r in requests), dtype=np.int64, count=len(requests))
        sets = np.fromiter((self._set_index(r.options) for r in requests), dtype=np.int32, count=len(requests))
        if groups is None:
            lengths = np.fromiter((len(r.token_ids) for r in requests), dtype=np.int64, count=len(requests))
            self.add_flat(row_ids, np.concatenate([r.token_ids for r in requests]), lengths, sets)
            return
        own, head_starts, head_lengths = [], np.zeros(len(requests), np.int64), np.zeros(len(requests), np.int32)
        at = self._total  # where the next own span starts in tokens
        for i, (request, group) in enumerate(zip(requests, groups)):
            tokens = np.asarray(request.token_ids, dtype=np.int32)
            if self._group is not None and self._group[0] == group:
                first = self._group[2]
                width = min(len(first), len(tokens))
                differ = np.flatnonzero(first[:width] != tokens[:width])
                shared = int(differ[0]) if len(differ) else width
                if shared >= MIN_HEAD:
                    head_starts[i], head_lengths[i] = self._group[1], shared
                    tokens = tokens[shared:]
            else:
                self._group = (group, at, tokens)
            own.append(tokens)
            at += len(tokens)
        lengths = np.fromiter((len(t) for t in own), dtype=np.int64, count=len(own))
        self.add_flat(row_ids, np.concatenate(own), lengths, sets, head_starts=head_starts, head_lengths=head_lengths)

    def add_flat(self, row_ids: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, option_sets: np.ndarray,
                 options: Sequence[OptionTokens] = (), head_starts: np.ndarray | None = None,
                 head_lengths: np.ndarray | None = None) -> None:
        """Append a batch given as arrays: `option_sets[i]` indexes `options` (-1: none); `lengths`
        the rows' own spans, after `head_lengths` tokens at `head_starts` (in the store's tokens)."""
        if len(row_ids) == 0:
            return
        if int(row_ids[0]) <= self._last_row_id or (len(row_ids) > 1 and (np.diff(row_ids) <= 0).any()):
            raise ValueError("rows must be added in increasing row id order")
        if len(options):
            remap = np.asarray([self._set_index(o) for o in options] + [-1], dtype=np.int32)
            option_sets = remap[option_sets]  # -1 picks the last entry: -1
        high = int(tokens.max()) if len(tokens) else 0  # one scan: the width check and max_token
        if self.token_dtype == _NARROW and (high > 0xFFFF or (len(tokens) and int(tokens.min()) < 0)):
            self._widen()
        self._tokens.write(np.ascontiguousarray(tokens, dtype=self.token_dtype).tobytes())
        offsets = self._total + np.cumsum(lengths, dtype=np.int64)
        self._offsets.write(offsets.tobytes())
        self._row_ids.write(np.ascontiguousarray(row_ids, dtype=np.int64).tobytes())
        self._option_set.write(np.ascontiguousarray(option_sets, dtype=np.int32).tobytes())
        self._rows_without_options += int((option_sets < 0).sum())
        self._add_heads(self.num_rows, len(row_ids), head_starts, head_lengths)
        self._total = int(offsets[-1])
        self.num_rows += len(row_ids)
        self.max_token = max(self.max_token, high)
        self._last_row_id = int(row_ids[-1])

    def _widen(self) -> None:
        """Rewrite the narrow token file written so far as int32 and go on in int32 (an id that
        does not fit 16 bits came; a large vocabulary meets one in its first batch)."""
        self._tokens.close()
        narrow, wide = self.folder / _TOKEN_FILES[_NARROW], self.folder / _TOKEN_FILES[_WIDE]
        count = narrow.stat().st_size // _NARROW.itemsize
        with open(wide, "wb") as out:
            for start in range(0, count, 1 << 24):
                chunk = np.fromfile(narrow, dtype=_NARROW, count=min(1 << 24, count - start),
                                    offset=start * _NARROW.itemsize)
                out.write(chunk.astype(_WIDE).tobytes())
        narrow.unlink()
        self.token_dtype = _WIDE
        self._tokens = open(wide, "ab")

    def _add_heads(self, first_row: int, count: int, starts: np.ndarray | None, lengths: np.ndarray | None) -> None:
        """Write the heads of `count` rows from position `first_row` on (None: none). The head
        files start at the first row that has one, with zeros for every row before it: a store
        whose rows have no heads has no head files."""
        if self._heads is None:
            if lengths is None or not np.any(lengths):
                return
            self._heads = (open(self.folder / "head_starts.i64", "wb"), open(self.folder / "head_lengths.i32", "wb"))
            for first in range(0, first_row, 1 << 22):
                rows = min(1 << 22, first_row - first)
                self._heads[0].write(np.zeros(rows, np.int64).tobytes())
                self._heads[1].write(np.zeros(rows, np.int32).tobytes())
        if lengths is None:
            starts, lengths = np.zeros(count, np.int64), np.zeros(count, np.int32)
        self._heads[0].write(np.ascontiguousarray(starts, dtype=np.int64).tobytes())
        self._heads[1].write(np.ascontiguousarray(lengths, dtype=np.int32).tobytes())
        self.head_tokens += int(np.sum(lengths, dtype=np.int64))

    def append_store(self, store: TokenStore, row_shift: int, chunk: int = 1 << 22) -> None:
        """Append every row and error of a finished `store` whose row ids count from 0, its row ids
        shifted by `row_shift` (the input rows before it): the files copied a chunk at a time,
        never all its tokens in memory; its option sets re-keyed into this store's, in the order a
        writer given its rows would have met them. Store segments become one store this way
        (store/segments.py)."""
        if store.num_rows:
            if int(store.row_ids[0]) + row_shift <= self._last_row_id:
                raise ValueError("rows must be added in increasing row id order")
            if store.token_dtype == _WIDE and self.token_dtype == _NARROW:  # a wide store holds an id past 16 bits
                self._widen()
            if store.token_dtype == self.token_dtype:  # the file copied as it is
                with open(store.folder / _TOKEN_FILES[store.token_dtype], "rb") as tokens:
                    shutil.copyfileobj(tokens, self._tokens, 1 << 24)
            else:  # another width: converted a chunk at a time
                for start in range(0, store.stored_tokens, 1 << 24):
                    piece = np.asarray(store.flat.tokens[start:start + (1 << 24)])
                    self._tokens.write(piece.astype(self.token_dtype).tobytes())
            remap = np.asarray([self._set_index(store._build_option_set(i))
                                for i in range(len(store._token_starts) - 1)] + [-1], dtype=np.int32)
            flat = store.flat
            for start in range(0, store.num_rows, chunk):
                end = min(start + chunk, store.num_rows)
                if flat.head_lengths is None:
                    self._add_heads(self.num_rows + start, end - start, None, None)
                else:  # its heads point into its own tokens, now after this store's
                    self._add_heads(self.num_rows + start, end - start,
                                    np.asarray(flat.head_starts[start:end]) + self._total, flat.head_lengths[start:end])
                self._offsets.write((np.asarray(flat.offsets[start + 1:end + 1]) + self._total).tobytes())
                self._row_ids.write((np.asarray(store.row_ids[start:end]) + row_shift).tobytes())
                sets = remap[np.asarray(store.option_set[start:end])]  # -1 picks the last entry: -1
                self._option_set.write(sets.tobytes())
                self._rows_without_options += int((sets < 0).sum())
            self._total += store.stored_tokens
            self.num_rows += store.num_rows
            self.max_token = max(self.max_token, store.max_token)
            self._last_row_id = int(store.row_ids[-1]) + row_shift
        with open(store.folder / "errors.jsonl", encoding="utf-8") as lines:
            for entry in map(json.loads, lines):
                entry["row"] += row_shift
                self._errors.write(json.dumps(entry) + "\n")
                self.num_errors += 1

    def append_positions(self, store: TokenStore, positions: np.ndarray, chunk: int = 1 << 16) -> None:
        """Append the rows at `positions` (increasing) of a finished `store`, their row ids kept: the
        rows an incremental run still scores (output/carry.py), a chunk of rows at a time, each
        row whole (a head the row read from a row not appended is written out)."""
        options = store.option_sets()
        for first in range(0, len(positions), chunk):
            at = np.asarray(positions[first:first + chunk], dtype=np.int64)
            tokens, lengths = store.flat.gather(at)
            self.add_flat(np.asarray(store.row_ids[at]), tokens, lengths, np.asarray(store.option_set[at]), options)

    def shared_single_token_ids(self) -> list[int] | None:
        """The label token ids when every row so far has the same one-token options (the
        one-position path: `RowOptionSource.single_token_ids`), else None."""
        if self.num_rows == 0 or self._rows_without_options or len(self._set_list) != 1 \
                or not self._set_list[0].single_token:
            return None
        return [int(t) for t in self._set_list[0].tokens]

    def add_errors(self, errors: dict[int, str] | Iterable[tuple[int, str]]) -> None:
        """Append row errors (row id -> message)."""
        items = errors.items() if isinstance(errors, dict) else errors
        for row, message in items:
            self._errors.write(json.dumps({"row": int(row), "error": str.__str__(message),
                                           "kind": kind_of(message)}) + "\n")
            self.num_errors += 1

    def close(self, num_input_rows: int, extra: dict | None = None) -> TokenStore:
        """Finish the store (the manifest last) and open it for reading."""
        for handle in (self._tokens, self._offsets, self._row_ids, self._option_set, self._errors, *(self._heads or ())):
            handle.close()
        tokens = [o.tokens for o in self._set_list]
        offsets = [o.offsets for o in self._set_list]
        np.savez(self.folder / "option_sets.npz",
                 tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
                 offsets=np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
                 token_counts=np.asarray([len(t) for t in tokens], dtype=np.int64),
                 option_counts=np.asarray([len(o) for o in offsets], dtype=np.int64))
        manifest = {"format": FORMAT, "identity": self.identity, "num_rows": self.num_rows,
                    "num_tokens": self._total, "num_errors": self.num_errors, "num_input_rows": int(num_input_rows),
                    "max_token": self.max_token, "head_tokens": self.head_tokens,
                    "token_dtype": self.token_dtype.str, **(extra or {})}
        manifest["files"] = {name: _file_digest(self.folder / name) for name in _FILES
                             if name != "manifest.json" and (self.folder / name).exists()}
        manifest["digest"] = _manifest_digest(manifest)
        text = json.dumps(manifest, indent=1)
        atomic_write(self.folder / "manifest.json", lambda tmp: Path(tmp).write_text(text))
        return TokenStore.open(self.folder)


def _file_digest(path: Path) -> dict:
    """A store file's size and sha256, recorded in the manifest. Read into one 1 MiB buffer: a new
    bytes object per piece kept two pieces alive at once, anonymous memory that grew with the store."""
    digest = hashlib.sha256()
    buffer = bytearray(1 << 20)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while count := handle.readinto(buffer):
            digest.update(view[:count])
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _manifest_digest(manifest: dict) -> str:
    """The manifest's own digest (of everything but this field): an edited count does not verify."""
    return hashlib.sha256(json.dumps({k: v for k, v in manifest.items() if k != "digest"},
                                     sort_keys=True).encode()).hexdigest()


def store_problem(folder: Path, manifest: dict) -> str | None:
    """Why the store in `folder` does not verify against its manifest (a file edited, truncated,
    removed or replaced by a link since it was written; the manifest edited), or None. The store is
    data the run trusts — scores are written under its row ids — so it is checked as the parts are."""
    if manifest.get("digest") != _manifest_digest(manifest) or not isinstance(manifest.get("files"), dict):
        return "its manifest does not match its own digest"
    for name, recorded in manifest["files"].items():
        path = Path(folder) / name
        if path.is_symlink() or not path.is_file():
            return f"{name} is missing or not a plain file"
        if path.stat().st_size != recorded.get("size"):
            return f"{name} has another size than when it was written"
        if _file_digest(path)["sha256"] != recorded.get("sha256"):
            return f"{name} has other contents than when it was written"
    return None


def _map(path: Path, dtype, count: int) -> np.ndarray:
    """A read-only memory map of `count` values (an empty file cannot be mapped)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TokenStore:
    """A finished store, memory-mapped (see the module docstring). Positions 0..num_rows-1 are
    the scorable rows in input order; `row_ids[pos]` is the input row."""

    def __init__(self, folder: Path, manifest: dict) -> None:
        self.folder = Path(folder)
        self.manifest = manifest
        n, t = manifest["num_rows"], manifest["num_tokens"]
        heads = (_map(self.folder / "head_starts.i64", np.int64, n), _map(self.folder / "head_lengths.i32", np.int32, n)) \
            if manifest.get("head_tokens") else (None, None)
        self.token_dtype = np.dtype(manifest.get("token_dtype", _WIDE.str))
        self.flat = FlatTokens(_map(self.folder / _TOKEN_FILES[self.token_dtype], self.token_dtype, t),
                               _map(self.folder / "offsets.i64", np.int64, n + 1) if n else np.zeros(1, np.int64), *heads)
        self.row_ids = _map(self.folder / "row_ids.i64", np.int64, n)
        self.option_set = _map(self.folder / "option_set.i32", np.int32, n)
        with np.load(self.folder / "option_sets.npz") as sets:
            self._set_tokens = sets["tokens"]
            self._set_offsets = sets["offsets"]
            token_counts, option_counts = sets["token_counts"], sets["option_counts"]
        self._token_starts = np.concatenate(([0], np.cumsum(token_counts))).astype(np.int64)
        self._offset_starts = np.concatenate(([0], np.cumsum(option_counts))).astype(np.int64)
        self._option_set_cache = lru_cache(maxsize=4096)(self._build_option_set)
        self.label_ids: list[int] | None = manifest.get("label_ids")  # one-token labels shared by every row

    @classmethod
    def open(cls, folder) -> TokenStore:
        """Open a finished store; raises FileNotFoundError when it is missing or incomplete."""
        manifest_path = Path(folder) / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT:
            raise FileNotFoundError(f"{folder}: a token store of another format ({manifest.get('format')})")
        return cls(Path(folder), manifest)

    @classmethod
    def reusable(cls, folder, identity: dict) -> TokenStore | None:
        """The store in `folder` if it is complete, was built from the same content and every file
        still verifies against its manifest (`store_problem`), else None (the caller rebuilds it;
        a store that does not verify is logged by name)."""
        try:
            manifest = json.loads((Path(folder) / "manifest.json").read_text())
        except (FileNotFoundError, ValueError, OSError):
            return None
        if not isinstance(manifest, dict) or manifest.get("identity") != identity_digest(identity):
            return None
        problem = store_problem(Path(folder), manifest)
        if problem is not None:
            log.warning("token store %s: %s; it is rebuilt", folder, problem)
            return None
        try:
            return cls.open(folder)
        except (FileNotFoundError, ValueError, KeyError, OSError):
            return None

    # ------------------------------------------------------------------ rows

    @property
    def num_rows(self) -> int:
        """Rows that can be scored (the store's positions)."""
        return self.manifest["num_rows"]

    @property
    def num_input_rows(self) -> int:
        """Every input row, scorable or not."""
        return self.manifest["num_input_rows"]

    @property
    def max_token(self) -> int:
        return self.manifest["max_token"]

    @property
    def lengths(self) -> np.ndarray:
        """[N] int64 each position's prompt length (computed from the offsets: 8 bytes a row)."""
        return self.flat.lengths

    @property
    def tokens_path(self) -> Path:
        """The token file (`tokens.u16` or `tokens.i32`: module docstring)."""
        return self.folder / _TOKEN_FILES[self.token_dtype]

    @property
    def stored_tokens(self) -> int:
        """The tokens the store's file holds (what rows share by construction, once)."""
        return self.manifest["num_tokens"]

    @property
    def logical_tokens(self) -> int:
        """The tokens of every row, each whole."""
        return self.manifest["num_tokens"] + self.manifest.get("head_tokens", 0)

    def tokens_of(self, position: int) -> np.ndarray:
        """Position's prompt token ids (a read-only int32 view of the map, a copy for a row with a head)."""
        return self.flat.row(position)

    def options_at(self, position: int) -> OptionTokens | None:
        """Position's options (None: the job's one-token labels, shared by every row)."""
        if self.label_ids is not None:
            return None
        index = int(self.option_set[position])
        return None if index < 0 else self._option_set_cache(index)

    def option_sets(self) -> list[OptionTokens]:
        """Every option set of the store, by index (`option_set[pos]` indexes it; -1: none)."""
        return [self._build_option_set(i) for i in range(len(self._token_starts) - 1)]

    def _build_option_set(self, index: int) -> OptionTokens:
        tokens = self._set_tokens[self._token_starts[index] : self._token_starts[index + 1]]
        offsets = self._set_offsets[self._offset_starts[index] : self._offset_starts[index + 1]]
        return OptionTokens(tokens, offsets)

    def request(self, position: int) -> Request:
        """Position as a Request (its tokens copied out of the map)."""
        return Request(int(self.row_ids[position]), np.array(self.tokens_of(position)), self.options_at(position))

    def requests(self, positions: Iterable[int] | None = None) -> list[Request]:
        """Requests for `positions` (default: every row; small stores only)."""
        return [self.request(p) for p in (range(self.num_rows) if positions is None else positions)]

    @property
    def errors(self) -> dict[int, str]:
        """Row id -> why the row cannot be scored, a typed RowError (read from the file on each call)."""
        with open(self.folder / "errors.jsonl", encoding="utf-8") as lines:
            return {entry["row"]: typed(entry["error"], entry.get("kind")) for entry in map(json.loads, lines)}

    def option_extra_rows(self) -> np.ndarray:
        """[N] int64 each position's `OptionTokens.extra_rows` (0 for none, and for the job's
        one-token labels): what a member's options add to its work, without an object per row."""
        sets = len(self._token_starts) - 1
        if sets == 0 or self.num_rows == 0 or self.label_ids is not None:
            return np.zeros(self.num_rows, dtype=np.int64)
        per_set = np.diff(self._token_starts) - (np.diff(self._offset_starts) - 1)
        index = np.asarray(self.option_set)
        return np.where(index >= 0, np.r_[per_set, 0][index], 0).astype(np.int64)

    def option_counts(self, positions: np.ndarray | None = None) -> tuple[int, int]:
        """(tokens plain forwards add for the rows' options, option positions computed), as
        plan/options.option_token_counts counts them, without an object per row; `positions`:
        of those positions only (a shard's share, an incremental night's carried rows)."""
        sets = len(self._token_starts) - 1
        if sets == 0 or self.num_rows == 0 or self.label_ids is not None:
            return 0, 0
        token_counts = np.diff(self._token_starts)
        option_counts = np.diff(self._offset_starts) - 1
        extra_rows = token_counts - option_counts  # n - 1 per option of n tokens
        index, lengths = np.asarray(self.option_set), self.lengths
        if positions is not None:
            index, lengths = index[positions], lengths[positions]
        has = index >= 0
        chosen = index[has]
        lengths = lengths[has]
        plain_extra = np.where(extra_rows[chosen] == 0, 0, (option_counts[chosen] - 1) * lengths + extra_rows[chosen])
        return int(plain_extra.sum()), int(extra_rows[chosen].sum())

    def remove(self) -> None:
        """Delete the store's files."""
        for name in _FILES:
            try:
                os.unlink(self.folder / name)
            except FileNotFoundError:
                pass


def store_folder(parts_folder) -> Path:
    """Where a run keeps its token store: inside its parts folder."""
    return Path(parts_folder) / "tokens"
