"""Attention over a range of a step's queries inside vLLM, so a decoder layer can run chunk by chunk.

vLLM builds a step's attention metadata once (per attention group) from a backend-neutral
`CommonAttentionMetadata` and hands it to every attention layer through the forward context.
`StepMetadata` remembers that common metadata as each group builds it; for the token range
`[start, end)` of the step it cuts the common metadata with vLLM's own micro-batch splitter
(`split_attn_metadata`: a request cut at the range's ends keeps the queries inside it, and the
keys up to its last query), has the same group's builder build the range's metadata, and swaps
it, with the range's slots, into the forward context while the range runs. An attention layer
then writes the range's k/v into the KV cache and attends its queries over every key up to
them: the keys of earlier ranges are already in the cache, and a prefix-cached request's cached
blocks are in its block table. So q, k, v, the attention output and the kernel's scratch span
the range, not the step.

Runs inside vLLM's worker (installed by `hybrid.chunk_rowwise`).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

_ORIGINAL = "_batchscore_unrecorded_build_metadata"
# Backends whose metadata builder returns fresh tensors on every call (checked in their source), so a
# range's metadata built mid-step leaves the step's own untouched. GPU builders may plan into
# persistent buffers: their layers keep attention over the whole step.
PURE_BUILDERS = ("CPU_ATTN",)


def supports_query_chunks(runner) -> bool:
    """Whether every attention group of `runner` (a vLLM model runner) has a backend in `PURE_BUILDERS`."""
    groups = [group for groups in getattr(runner, "attn_groups", []) for group in groups]
    return bool(groups) and all(group.backend.get_name() in PURE_BUILDERS for group in groups)


class StepMetadata:
    """The common attention metadata of the step now running, per attention group of `runner`
    (a vLLM model runner), and the metadata of token ranges of that step."""

    def __init__(self, runner) -> None:
        self._groups = [group for groups in getattr(runner, "attn_groups", []) for group in groups]
        self._common: dict[int, tuple[object, object]] = {}  # id(group) -> (common, built metadata)
        self._ranges: dict[tuple[int, int], tuple[dict, dict]] = {}
        self._step = None  # the forward context's metadata dict the cached ranges belong to
        for group in self._groups:
            build = group.__dict__.get(_ORIGINAL) or group.build_metadata
            group.__dict__[_ORIGINAL] = build
            group.build_metadata = self._recording(group, build)

    def remove(self) -> None:
        """Give the attention groups back their own `build_metadata`."""
        for group in self._groups:
            if _ORIGINAL in group.__dict__:
                del group.build_metadata, group.__dict__[_ORIGINAL]
        self._common.clear(), self._ranges.clear()
        self._step = None

    def _recording(self, group, build):
        def build_metadata(common, ubatch_idx=0, *args, **kwargs):
            metadata = build(common, ubatch_idx, *args, **kwargs)
            self._common[id(group)] = (common, metadata)
            return metadata
        return build_metadata

    def splittable(self, rows: int) -> bool:
        """Whether this step's `rows` tokens can run in ranges: one metadata dict (no micro-batches),
        every layer's metadata built from a recorded common metadata covering exactly `rows` tokens
        (no padding rows)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return False
        context = get_forward_context()
        if not isinstance(context.attn_metadata, dict) or not isinstance(context.slot_mapping, dict) \
                or context.ubatch_slices is not None or not context.attn_metadata:
            return False
        for metadata in context.attn_metadata.values():
            found = self._common_of(metadata)
            if found is None or found[1].num_actual_tokens != rows or int(found[1].query_start_loc_cpu[-1]) != rows:
                return False
        return True

    def _common_of(self, metadata):
        for group in self._groups:
            common, built = self._common.get(id(group), (None, None))
            if built is metadata:
                return group, common
        return None

    @contextmanager
    def queries(self, start: int, end: int):
        """Within it, attention layers run the step's tokens `[start, end)` only (see the module)."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if self._step is not context.attn_metadata:  # a new step: earlier ranges are stale
            self._ranges.clear()
            self._step = context.attn_metadata
        cut = self._ranges.get((start, end))
        if cut is None:
            cut = self._ranges[(start, end)] = self._cut(context, start, end)
        whole = context.attn_metadata, context.slot_mapping
        context.attn_metadata, context.slot_mapping = cut
        try:
            yield
        finally:
            context.attn_metadata, context.slot_mapping = whole

    def _cut(self, context, start: int, end: int) -> tuple[dict, dict]:
        from vllm.v1.worker.ubatch_utils import UBatchSlice, split_attn_metadata

        built: dict[int, object] = {}  # id(step metadata) -> the range's
        metadata = {}
        for layer, step_metadata in context.attn_metadata.items():
            if id(step_metadata) not in built:
                group, common = self._common_of(step_metadata)
                starts = common.query_start_loc_cpu.numpy()
                first = int(np.searchsorted(starts, start, side="right")) - 1
                last = int(np.searchsorted(starts, end - 1, side="right")) - 1
                (part,) = split_attn_metadata([UBatchSlice(slice(first, last + 1), slice(start, end))], common)
                built[id(step_metadata)] = group.__dict__[_ORIGINAL](part)
            metadata[layer] = built[id(step_metadata)]
        slots = {layer: mapping[start:end] for layer, mapping in context.slot_mapping.items()}
        return metadata, slots
