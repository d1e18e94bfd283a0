"""A content digest of one Arrow column: the same whatever chunks the column arrives in.

The run identity fingerprints each Parquet input column on its own (output/identity.py), so an
edit to a column the scores do not depend on (a truth or kept column) leaves the scoring identity
as it was. The digest reads the decoded values, not the file's bytes: a file written again with
other row groups or compression but the same values has the same digests.

Every part of an array feeds a stream of its own, keyed by its path in the type (a struct's
fields, a list's values): the value lengths, the value bytes, and the positions of the nulls.
Streams are hashed in order, so cutting a column into other chunks changes nothing. Work is
vectorized over Arrow buffers and numpy (no Python per row), except for types Arrow cannot cast
to text (a union, an extension type), which are rare.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class ColumnDigest:
    """Feed a column's chunks in order with `update`; `hexdigest` names its values."""

    def __init__(self) -> None:
        self.rows = 0
        self._type: str | None = None
        self._streams: dict[str, "hashlib._Hash"] = {}
        self._seen: dict[str, int] = {}  # values fed per path: where the next chunk's nulls start

    def update(self, array: pa.Array | pa.ChunkedArray) -> None:
        chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
        for chunk in chunks:
            chunk = _decoded(chunk)
            if self._type is None:
                self._type = _kind(chunk.type)
            self.rows += len(chunk)
            self._feed(chunk, "")

    def hexdigest(self) -> str:
        digest = hashlib.sha256(f"{self._type}|{self.rows}".encode())
        for path in sorted(self._streams):
            digest.update(f"|{path}:{self._streams[path].hexdigest()}".encode())
        return digest.hexdigest()

    def _stream(self, path: str) -> "hashlib._Hash":
        stream = self._streams.get(path)
        if stream is None:
            stream = self._streams[path] = hashlib.sha256()
        return stream

    def _feed(self, array: pa.Array, path: str) -> None:
        array = _decoded(array)
        kind = array.type
        start = self._seen.get(path, 0)
        self._seen[path] = start + len(array)
        if array.null_count:
            nulls = np.flatnonzero(~_valid(array)) + start
            self._stream(path + "#nulls").update(nulls.astype(np.int64).tobytes())
        if len(array) == 0 or pa.types.is_null(kind):
            return
        if pa.types.is_string(kind) or pa.types.is_binary(kind) or pa.types.is_large_string(kind) \
                or pa.types.is_large_binary(kind):
            self._feed_bytes(array, path)
        elif pa.types.is_boolean(kind):
            values = np.asarray(array.fill_null(False).to_numpy(zero_copy_only=False), dtype=np.uint8)
            self._stream(path + "#values").update(values.tobytes())
        elif _fixed_width(kind):
            self._feed_fixed(array, path)
        elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
            self._stream(path + "#lengths").update(_list_lengths(array).tobytes())
            self._feed(array.flatten(), path + "[]")
        elif pa.types.is_struct(kind):
            for i, child in enumerate(array.flatten()):
                self._feed(child, f"{path}.{kind.field(i).name}")
        else:
            self._feed_text(array, path)

    def _feed_bytes(self, array: pa.Array, path: str) -> None:
        """Variable-length strings or bytes: each value's length, then the values' bytes."""
        if array.null_count:
            array = array.fill_null(pa.scalar(b"" if pa.types.is_binary(array.type)
                                              or pa.types.is_large_binary(array.type) else "", array.type))
        buffers = array.buffers()
        width = np.int64 if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type) else np.int32
        offsets = np.frombuffer(buffers[1], dtype=width)[array.offset:array.offset + len(array) + 1]
        self._stream(path + "#lengths").update(np.diff(offsets).astype(np.int64).tobytes())
        if buffers[2] is not None and offsets[-1] > offsets[0]:
            self._stream(path + "#values").update(memoryview(buffers[2])[int(offsets[0]):int(offsets[-1])])

    def _feed_fixed(self, array: pa.Array, path: str) -> None:
        """Fixed-width values (numbers, times, decimals): their bytes, a null's slot as zeros."""
        width = array.type.bit_width // 8
        raw = np.frombuffer(array.buffers()[1], dtype=np.uint8)[array.offset * width:(array.offset + len(array)) * width]
        if array.null_count:
            raw = raw.reshape(len(array), width).copy()
            raw[~_valid(array)] = 0
        self._stream(path + "#values").update(np.ascontiguousarray(raw).tobytes())

    def _feed_text(self, array: pa.Array, path: str) -> None:
        """Any other type, by its values as text."""
        try:
            text = pc.cast(array, pa.string())
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
            text = pa.array([None if v is None else repr(v) for v in array.to_pylist()], type=pa.string())
        self._feed_bytes(text, path + "~text")


def _decoded(array: pa.Array) -> pa.Array:
    """A dictionary column by its values; a map as the list of key/value pairs it is."""
    if pa.types.is_dictionary(array.type):
        return array.dictionary_decode()
    if pa.types.is_map(array.type):
        return array.cast(pa.list_(pa.struct([array.type.key_field, array.type.item_field])))
    return array


def _list_lengths(array: pa.Array) -> np.ndarray:
    """Each list's length (0 for a null list), as int64."""
    if pa.types.is_fixed_size_list(array.type):
        lengths = np.full(len(array), array.type.list_size, dtype=np.int64)
    else:
        lengths = np.diff(np.asarray(array.offsets.to_numpy(zero_copy_only=False), dtype=np.int64))
    if array.null_count:
        lengths[~_valid(array)] = 0
    return lengths


def _valid(array: pa.Array) -> np.ndarray:
    return np.asarray(array.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def _fixed_width(kind: pa.DataType) -> bool:
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_temporal(kind)
            or pa.types.is_decimal(kind) or pa.types.is_fixed_size_binary(kind)):
        return False
    try:
        return kind.bit_width % 8 == 0 and kind.bit_width > 0
    except ValueError:
        return False


def _kind(kind: pa.DataType) -> str:
    """The type, with the choices of physical layout that do not change a value made alike."""
    if pa.types.is_dictionary(kind):
        return _kind(kind.value_type)
    return str(kind).replace("large_string", "string").replace("large_binary", "binary") \
        .replace("large_list", "list")
