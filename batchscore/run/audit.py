"""The exactness audit: every run re-scores a few random scored rows through a plain float32
forward and records how far the run's probabilities are from it (`audit_max_dp`).

The reference is deliberately naive and shares nothing with the engines: a fresh transformers
`AutoModelForCausalLM` in float32 (whatever dtype the run used), one plain forward of a row's
whole prompt — no prefix sharing with other rows, no batching, no padding — and the row's
multi-token options as a continuation of that forward's own transformers KV cache; every read
position goes through a full-vocabulary log-softmax in float64.
One-token labels are read at the prompt's last position; an option of n tokens is the sum of its
tokens' log-probabilities. Both sides are then normalized the same way (`score.normalize`; the
reads of a decision job by their sum, as their answers are) and compared label by label.

Above the bound (`output.audit_max_dp`, default the one the docs state for the run's dtype) the
run still writes its output, then stops with `AuditFailed` (exit 7) naming the rows that differ.

A reduced-precision run (bfloat16, float16) is also measured against its dtype's own rounding: the
same rows go through the same plain forward in the run's dtype, and with no `output.audit_max_dp` of the job's the bound becomes
`max(DTYPE_BOUNDS[dtype], PLAIN_MARGIN × the plain forward's largest |ΔP|)` on those rows: a row
is flagged only when the engine is further from float32 than the documented bound *and* clearly
further than the plain forward in the same dtype gets on any audited row (docs/jobs.md).

Cost: by default (`output.audit_rows: null`) the audit takes rows, spread across the plan's prefix
groups, while their plain forwards stay within AUDIT_SHARE of the tokens the run processed — at
least one row, at most AUTO_MAX_ROWS. A row's cost counts its real forwards: its prompt, and the
tokens of its multi-token options. A number in `output.audit_rows` forces that many.
The run holds the output's lock through the audit: the completion marker records the audit's
result, and until it is written another run would assemble the same output again.

Weights: a local torch run hands its engine's loaded model over (`EngineWeights`). The plain
forward in the engine's dtype — the reference itself in a float32 run, the same-dtype forward in a
reduced-precision one — then runs on a *twin* (`plain_twin`): a fresh transformers model of the
same architecture, its own modules and the attention implementation the model was loaded with,
whose parameters and buffers are the engine's tensors (shared, never copied or written). The
weights come from the same file through the same loader either way; what is reused is a second
load and a second copy in memory. The engine's model is dropped as soon as its forwards are done,
before a float32 reference of a reduced-precision run is loaded, so the two never sit side by side.
Otherwise (Ray workers, vLLM, a model the twin cannot mirror) the audit loads what it needs (in a
reduced-precision run, the model in the run's dtype: loading it measured ~8x faster here than
casting the float32 reference down, and gives the same weights).
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager

import numpy as np

from batchscore.errors import AuditFailed
from batchscore.faults import fault_point
from batchscore.output.summary import Audit
from batchscore.scores.quality import content_free_rows
from batchscore.output.raw_scores import RowScores
from batchscore.prepare.options import choices_problem

log = logging.getLogger("batchscore")

# The documented max |ΔP| against the float32 plain forward (README, docs/performance.md): float32
# is tested to 1e-4; bfloat16 stays within 0.07 on the sample job. float16 has more mantissa bits
# than bfloat16, so bfloat16's bound holds for it too.
DTYPE_BOUNDS = {"float32": 1e-4, "bfloat16": 0.07, "float16": 0.07}
# In a reduced-precision run, a row differs only when its |ΔP| is also above PLAIN_MARGIN × the largest
# |ΔP| the plain forward in the run's dtype shows on the audited rows (see docs/jobs.md for why 2).
REDUCED_PRECISION = ("bfloat16", "float16")
PLAIN_MARGIN = 2.0
SHOWN_ROWS = 10  # rows named in the summary and the error (largest |ΔP| first)
AUDIT_SHARE = 0.05  # the default audit's plain-forward tokens, at most this share of the run's processed tokens
AUTO_MAX_ROWS = 32  # ...and at most this many rows (at least one)


AuditResult = Audit  # what the audit found: the run summary's audit part


def audit_bound(config, dtype: str) -> float | None:
    """The job's bound: output.audit_max_dp, else the documented one for `dtype`; None (record,
    never fail) for speculative prefill's approximate scores unless the job sets one."""
    if config.output.audit_max_dp is not None:
        return config.output.audit_max_dp
    if config.engine.speculative is not None:
        return None
    return DTYPE_BOUNDS.get(dtype, DTYPE_BOUNDS["bfloat16"])


def relative_bound(floor: float, plain_max_dp: float) -> float:
    """A reduced-precision run's bound when the job sets none: above the dtype's documented `floor`
    and above PLAIN_MARGIN × the plain same-dtype forward's largest |ΔP| on the same rows."""
    return max(floor, PLAIN_MARGIN * plain_max_dp)


def pick_rows(candidates: np.ndarray, count: int, seed: int) -> np.ndarray:
    """`count` of `candidates` (row ids) drawn without replacement by a generator seeded with
    `seed`, in row order; all of them when there are fewer."""
    candidates = np.sort(np.asarray(candidates, dtype=np.int64))
    if len(candidates) <= count:
        return candidates
    return np.sort(np.random.default_rng(seed).choice(candidates, size=count, replace=False))


def reference_cost(request, label_ids) -> int:
    """Tokens of the forwards `reference_totals` runs for `request`: its prompt, and option[:-1] of
    each option longer than one token (continuing the prompt's cache)."""
    prompt = len(request.token_ids)
    if request.options is None or label_ids is not None:
        return prompt
    lengths = np.asarray(request.options.lengths, dtype=np.int64)
    return prompt + int(np.sum(lengths[lengths > 1] - 1))


def budget_rows(candidates: np.ndarray, costs: dict[int, int], group_of: dict[int, int], budget: float,
                seed: int, max_rows: int = AUTO_MAX_ROWS) -> np.ndarray:
    """Rows of `candidates` whose `costs` sum to at most `budget`, at most `max_rows`, in row order:
    a seeded shuffle taken round-robin over the prefix groups (`group_of`: row -> group), so a few
    rows still come from different groups. When no row fits, the cheapest one (the audit always
    checks at least one)."""
    order = np.random.default_rng(seed).permutation(np.sort(np.asarray(candidates, dtype=np.int64)))
    seen: dict[int, int] = {}
    rank = []
    for row in order.tolist():  # a row's rank among the rows of its group drawn before it
        group = group_of.get(row, -1 - row)
        rank.append(seen.get(group, 0))
        seen[group] = rank[-1] + 1
    picked, spent = [], 0
    for row in order[np.argsort(rank, kind="stable")].tolist():
        if len(picked) >= max_rows:
            break
        if spent + costs[row] > budget:
            continue
        picked.append(row)
        spent += costs[row]
    if not picked and len(order):
        picked = [min(order.tolist(), key=lambda row: costs[row])]  # the first drawn of the cheapest
    return np.sort(np.array(picked, dtype=np.int64))


class EngineWeights:
    """The scoring engine's loaded torch model, handed to the audit once (`take`) so its plain forward
    in that model's dtype reuses the weights (module docstring). Empty for an engine without one."""

    def __init__(self, model=None, attention: str | None = None):
        self._model, self.attention = model, attention

    @classmethod
    def of(cls, engine) -> "EngineWeights":
        """The weights of `engine` (a TorchEngine whose scoring is done: its model as transformers
        built it, `plain_model`, and the attention it was loaded with)."""
        plain_model, attention = getattr(engine, "plain_model", None), getattr(engine, "plain_attention", None)
        model = plain_model() if callable(plain_model) else None
        return cls(model, attention) if attention is not None and hasattr(model, "state_dict") else cls()

    def take(self):
        """The model (None when there is none or it was taken): the caller holds the only reference."""
        model, self._model = self._model, None
        return model


def audit_output(job, store, manifests, group_of: dict[int, int] | None = None, processed_tokens: int = 0,
                 weights: EngineWeights | None = None) -> AuditResult:
    """Re-score a sample of the scored rows of `job` (a PreparedJob whose output was just assembled
    from `store`'s parts) through the plain float32 reference; returns what it found. The sample:
    `output.audit_rows` seeded rows, or by default rows spread over their prefix groups (`group_of`:
    row -> the plan's group, run/ranges.audit_sample) within AUDIT_SHARE of
    `processed_tokens` (see the module docstring). `weights`: the engine's model, reused for the plain
    forward in its dtype and dropped here; otherwise loads a fresh model (freed before returning).
    Changes nothing on disk."""
    config = job.config
    bound = audit_bound(config, job.source.engine.dtype)
    if config.output.audit_rows == 0:
        return AuditResult(bound=bound, skipped="output.audit_rows is 0")
    started = time.perf_counter()
    # the parts also hold contextual calibration's content-free row, one past the input rows
    # input rows only, not the content-free one; only their results are read (a part at a time)
    candidates = np.unique(np.array([r.row_id for r in job.input.requests if r.row_id < job.input.num_rows],
                                    dtype=np.int64))
    scores, errors = store.read_results(manifests, job.input.num_rows + content_free_rows(config), only=candidates)
    scored = np.array([row for row in candidates.tolist() if row not in errors], dtype=np.int64)
    scored = np.setdiff1d(scored, candidates[scores.unscored()])
    if len(scored) == 0:
        return AuditResult(bound=bound, skipped="no row was scored")
    if config.output.audit_rows is not None:
        rows = pick_rows(scored, config.output.audit_rows, config.output.audit_seed)
    else:
        by_row = {r.row_id: r for r in job.input.requests}
        costs = {int(row): reference_cost(by_row[int(row)], job.label_ids) for row in scored}
        rows = budget_rows(scored, costs, group_of or {}, AUDIT_SHARE * processed_tokens, config.output.audit_seed)
    wanted = set(rows.tolist())
    requests = {r.row_id: r for r in job.input.requests if r.row_id in wanted}
    tokens = sum(reference_cost(requests[row], job.label_ids) for row in wanted)
    dtype, device = job.source.engine.dtype, job.source.engine.device

    def totals_of(model) -> dict:
        return {row: reference_totals(model, requests[row].token_ids, job.label_ids, requests[row].options)
                for row in rows.tolist()}

    weights = weights or EngineWeights()
    engine_model, attention = weights.take(), weights.attention  # this frame holds the only reference
    plain_totals = None
    if dtype in REDUCED_PRECISION:  # the same plain forward in the run's dtype (the dtype's own rounding),
        # first: on the engine's own weights when it handed them over, dropped before the float32 load
        try:
            same_dtype = plain_twin(engine_model, dtype, attention) or load_reference(job.model_dir, device, dtype)
        except _load_errors() as exc:
            log.warning("exactness audit: no plain %s forward (%s); the dtype's documented bound applies", dtype, exc)
        else:
            on_gpu = next(same_dtype.parameters()).is_cuda
            try:
                plain_totals = totals_of(same_dtype)
            finally:
                del same_dtype
                engine_model = None
                _release_gpu_memory(on_gpu)
    try:  # a float32 run's engine weights are the reference's (a twin); otherwise a load
        reference = plain_twin(engine_model, "float32", attention) or load_reference(job.model_dir, device)
    except _load_errors() as exc:  # the output is written: a missing reference is recorded, not fatal
        reason = f"the float32 reference model could not be loaded on {device}: {exc}"
        log.warning("exactness audit skipped: %s", reason)
        return AuditResult(bound=bound, seconds=time.perf_counter() - started, skipped=reason, tokens=0)
    engine_model = None
    on_gpu = next(reference.parameters()).is_cuda
    try:
        fault_point("audit")
        expected = totals_of(reference)
        divisors = {row: _divisors(job, row, requests[row]) for row in rows.tolist()}
        deltas = {row: max_abs_dp(_engine_totals(scores, int(np.searchsorted(candidates, row))), expected[row],
                                  divisors[row]) for row in expected}
    finally:
        del reference
        _release_gpu_memory(on_gpu)
    plain = ({row: max_abs_dp(plain_totals[row], expected[row], divisors[row]) for row in expected}
             if plain_totals is not None else {})
    plain_max = max(plain.values()) if plain else None
    if plain and config.output.audit_max_dp is None and bound is not None:
        bound = relative_bound(bound, plain_max)  # the job's own bound, when it sets one, wins
    max_dp = max(deltas.values())
    over = sorted((r for r, d in deltas.items() if bound is not None and d > bound), key=lambda r: -deltas[r])
    plain_of = (lambda r: f" (plain {dtype} forward {plain[r]:.3g})") if plain else (lambda r: "")
    result = AuditResult(rows=len(rows), max_dp=max_dp, bound=bound, seconds=time.perf_counter() - started,
                         tokens=tokens * (2 if plain else 1), mean_dp=float(np.mean(list(deltas.values()))),
                         plain_max_dp=plain_max, plain_mean_dp=float(np.mean(list(plain.values()))) if plain else None,
                         differing=[f"{row_name(job, r)}: |ΔP| {deltas[r]:.3g}{plain_of(r)}" for r in over[:SHOWN_ROWS]])
    if len(over) > SHOWN_ROWS:
        result.differing.append(f"... and {len(over) - SHOWN_ROWS} more")
    log.info("exactness audit: %d rows re-scored (%d plain-forward tokens) in %.1f s, max |ΔP| %.3g%s (bound %s)",
             result.rows, result.tokens, result.seconds, max_dp,
             f", plain {dtype} forward {plain_max:.3g}" if plain else "", "none" if bound is None else f"{bound:g}")
    return result


def raise_if_inexact(summary) -> None:
    """Raise AuditFailed (exit 7) when `summary` (a RunSummary whose output is written) records a
    max |ΔP| above its audit bound."""
    audit = summary.audit
    if audit.max_dp is None or audit.bound is None or audit.max_dp <= audit.bound:
        return
    named = [d for d in audit.differing if not d.startswith("... and ")]
    more = sum(int(d.split()[2]) for d in audit.differing if d.startswith("... and "))
    plain = ("" if audit.plain_max_dp is None else
             f"; the plain forward in the run's dtype reaches {audit.plain_max_dp:.3g} on the same rows")
    raise AuditFailed(
        f"exactness audit: {len(named) + more} of {audit.rows} re-scored rows differ from a plain "
        f"float32 forward by more than |ΔP| {audit.bound:g} (output.audit_max_dp; max "
        f"{audit.max_dp:.3g}{plain}): {'; '.join(audit.differing)}. The output was written to "
        f"{summary.output_path}; do not act on its scores until the cause is known (a bfloat16 run: compare "
        "with engine.dtype: float32; otherwise report these rows)", summary)


# ---------------------------------------------------------------------------- the reference


def load_reference(model_dir, device: str, dtype: str = "float32"):
    """A fresh transformers model of `model_dir` in `dtype` (float32: the reference) on `device`,
    in eval mode: its own attention implementation, nothing of the engines'."""
    import torch
    from transformers import AutoModelForCausalLM

    on_gpu = device.startswith("cuda")  # straight onto the GPU: no float32 copy in host memory first
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype), local_files_only=True,
                                                 device_map=device if on_gpu else None)
    return (model if on_gpu else model.to(device)).eval()


def plain_twin(model, dtype: str, attention: str | None):
    """A plain transformers model mirroring `model` (module docstring, "Weights"): built from a copy of
    its config on the meta device with `attention` as its attention implementation, then given
    `model`'s parameters and buffers themselves (no copy). None when there is no `model`, it is not in
    `dtype`, or its tensors do not map one to one onto the fresh model (then the caller loads)."""
    if model is None or attention is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    if next(model.parameters()).dtype != getattr(torch, dtype):
        return None
    config = copy.deepcopy(model.config)
    config._attn_implementation = attention
    try:
        with torch.device("meta"):
            twin = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        twin.load_state_dict(model.state_dict(), strict=True, assign=True)
        for name, buffer in model.named_buffers(remove_duplicate=False):  # non-persistent ones too (RoPE)
            owner, _, leaf = name.rpartition(".")
            twin.get_submodule(owner)._buffers[leaf] = buffer
    except (RuntimeError, KeyError, AttributeError, ValueError) as exc:
        log.info("exactness audit: the engine's weights do not map onto a plain model (%s); loading them", exc)
        return None
    if any(t.is_meta for t in (*twin.parameters(), *twin.buffers())):
        return None
    return twin.eval()


AUDIT_BATCH = 16  # option sequences of one length per plain forward


def reference_totals(model, prompt: np.ndarray, label_ids, options) -> np.ndarray:
    """[K] each label's (`label_ids`, read at the prompt's last position) or option's total
    log-probability after `prompt` under `model`: one plain forward of the prompt (no padding, no
    batching with other rows; the LM head at its last position only), then the multi-token options
    as a continuation of that forward's own transformers KV cache (nothing of the engines'); float64
    log-softmax over the whole vocabulary at every read position."""
    import torch

    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64)[None], device=device)  # [1, T]
    with torch.inference_mode(), _full_float32():
        out = model(input_ids=ids, use_cache=options is not None, logits_to_keep=1)
    last = torch.log_softmax(out.logits[0, -1].double(), dim=-1)  # [V] the next token after the prompt
    if options is None:
        return last[torch.as_tensor(list(label_ids), device=device)].cpu().numpy()
    totals = np.array([float(last[int(options.option(i)[0])]) for i in range(options.count)])  # first tokens
    longer = [i for i in range(options.count) if len(options.option(i)) > 1]
    # the multi-token options continue the prompt's cache as one batch, a few at a time (memory), each
    # right-padded to the longest: a padding token comes after every position read, so it changes none
    chunks = [longer[start : start + AUDIT_BATCH] for start in range(0, len(longer), AUDIT_BATCH)]
    for number, chunk in enumerate(chunks):
        width = max(len(options.option(i)) for i in chunk)
        opts = np.zeros((len(chunk), width), dtype=np.int64)  # [S, n]
        for row, i in enumerate(chunk):
            opts[row, : len(options.option(i))] = options.option(i)
        # the last chunk may take the prompt's cache itself; earlier ones a copy of it
        cache = out.past_key_values if number == len(chunks) - 1 else copy.deepcopy(out.past_key_values)
        cache.batch_repeat_interleave(len(chunk))
        with torch.inference_mode(), _full_float32():
            logits = model(input_ids=torch.as_tensor(opts[:, :-1], device=device), past_key_values=cache,
                           use_cache=True).logits  # [S, n-1, V]
        picked = torch.log_softmax(logits.double(), dim=-1).gather(
            2, torch.as_tensor(opts[:, 1:], device=device)[:, :, None])[:, :, 0].cpu().numpy()  # [S, n-1]
        for row, i in enumerate(chunk):
            totals[i] += float(picked[row, : len(options.option(i)) - 1].sum())
        del cache
    return totals


def _load_errors() -> tuple[type[BaseException], ...]:
    """What loading the reference may raise that is about this machine, not a bug: no memory
    (host or GPU), unreadable weights, an architecture transformers does not know."""
    import torch

    return OSError, ValueError, MemoryError, torch.cuda.OutOfMemoryError


@contextmanager
def _full_float32():
    """float32 matmuls at full precision (no TF32 on a GPU) for the duration."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _release_gpu_memory(on_gpu: bool) -> None:
    """Hand the freed reference's GPU memory back (after its last reference is dropped)."""
    if on_gpu:
        import torch

        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- comparing


def max_abs_dp(engine: np.ndarray, reference: np.ndarray, divisors: np.ndarray | None) -> float:
    """max over the options of |P_engine − P_reference|, both softmax-normalized over the options
    of totals / divisors; 1.0 (the largest possible) when either side is not finite."""
    p, q = _normalized(engine, divisors), _normalized(reference, divisors)
    if p.shape != q.shape or not (np.isfinite(p).all() and np.isfinite(q).all()):
        return 1.0
    return float(np.max(np.abs(p - q)))


def _normalized(totals: np.ndarray, divisors: np.ndarray | None) -> np.ndarray:
    values = np.asarray(totals, dtype=np.float64) / (1.0 if divisors is None else divisors)
    shifted = np.exp(values - np.max(values))
    return shifted / shifted.sum()


def _engine_totals(scores: RowScores, index: int) -> np.ndarray:
    """The engine's option totals at `index` of `scores` (read with `only`: the index among those rows)."""
    return np.asarray(scores.logp[index].as_py(), dtype=np.float64)


def _divisors(job, row: int, request) -> np.ndarray | None:
    """What `score.normalize` divides a row's totals by (scores/normalize.py); None for `sum` and for
    a decision job's reads (their answers normalize the sum)."""
    normalize = job.config.score.normalize
    if normalize == "sum" or job.task.audit_by_sum:
        return None
    if normalize == "token":
        count = len(job.label_ids) if job.label_ids is not None else request.options.count
        return np.ones(count) if request.options is None else request.options.lengths.astype(np.float64)
    if job.config.labels:
        texts = job.config.labels
    else:
        texts = choices_problem(job.input.choices[row].as_py())[0]
    return np.array([len(t.encode("utf-8")) for t in texts], dtype=np.float64)


def row_name(job, row: int) -> str:
    """How the output names `row`, as the job's task names it: its id (and row number); for a
    questions job, the record's id and the question the read answers."""
    return job.task.row_name(job.input, row)
