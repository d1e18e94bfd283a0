"""`batchscore bench scale`: N rows through the real run path, killed once and resumed.

The job runs as `batchscore run` runs it (`runner.run_job`) in a child process, with one
stand-in: the engine (`bench/standin.py`, a CRC-32 of each prompt's tokens: deterministic and
instant — scoring millions of rows does not fit a 2-core CPU). Reading, rendering and tokenizing
(`--text`: documents × questions through a template and the built-in model's tokenizer; else
pre-tokenized Parquet), planning, placing, writing parts, resuming and assembling are the
production code. The first child is killed with SIGKILL (`BATCHSCORE_FAULT=part:K`, faults.py)
after about half its parts; the second resumes it. The benchmark then checks every row is in the
output once, in input order, with the score its tokens call for.

Per stage (the runner announces them, run/stages.py; `open` is locating and fingerprinting the
job): seconds, rows/s, logical tokens/s and the peak anonymous resident memory (RssAnon of
/proc/self/status, sampled every 10 ms: memory-mapped files do not count).

`--plan-only` plans N generated token rows (a memory-mapped flat file, `generated_rows`) with
`plan_rows`, the planner every job runs, and cuts the plan into `--workers` ranges; no run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from batchscore.plan.sorted_rows import FlatTokens

DOCUMENT_WORDS = ("market", "energy", "council", "report", "league", "season", "policy", "growth", "film",
                  "music", "school", "health", "court", "budget", "storm", "river", "company", "price",
                  "shares", "record", "minister", "players", "festival", "science", "election", "police")
QUESTIONS = ("Is this article about business?", "Is this article about politics?", "Is this article about sport?",
             "Is this article about technology?", "Is this article about entertainment?")


# ------------------------------------------------------------------ memory


def rss_anon() -> int:
    """This process's anonymous resident memory now (bytes): RssAnon of /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class StageMeter:
    """Seconds and peak RssAnon per stage: a thread samples RssAnon every `interval` seconds and
    charges it to the stage running; `enter(name)` starts the next stage. `on_change` is called
    with the table after each stage ends (the child saves it: a SIGKILL loses at most one stage)."""

    def __init__(self, interval: float = 0.01, on_change=None):
        self.interval, self.on_change = interval, on_change
        self.stages: dict[str, dict] = {}
        self.current: str | None = None
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def enter(self, name: str) -> None:
        now = time.perf_counter()
        if self.current is not None:
            self.stages[self.current]["seconds"] = now - self.started
            self._peak()
            if self.on_change is not None:
                self.on_change(self.stages)
        self.current, self.started = name, now
        self.stages[name] = {"seconds": 0.0, "peak_anon": rss_anon()}

    def _peak(self) -> None:
        entry = self.stages.get(self.current) if self.current else None
        if entry is not None:
            entry["peak_anon"] = max(entry["peak_anon"], rss_anon())

    def _sample(self) -> None:
        saved = time.perf_counter()
        while not self._stop.wait(self.interval):
            self._peak()
            if self.on_change is not None and time.perf_counter() - saved >= 1.0 and self.current in self.stages:
                saved = time.perf_counter()  # the stage so far, in case the process is killed inside it
                self.on_change({**self.stages, self.current: {**self.stages[self.current],
                                                              "seconds": saved - self.started}})

    def close(self) -> dict[str, dict]:
        self.enter("done")
        self._stop.set()
        self.stages.pop("done")
        return self.stages


# ------------------------------------------------------------------ inputs


def write_token_input(path: Path, rows: int, group_size: int, prefix_len: int, distinct_len: int, seed: int,
                      chunk: int = 500_000, changed_every: int = 0, choices: bool = False) -> None:
    """Pre-tokenized prompts: groups of `group_size` rows sharing a prefix, shuffled; written in
    chunks (a 10M-row input never sits in memory whole). Row i's tokens: `token_rows(...)`
    (`changed_every`: every such row's own tokens changed, the next night's input); `choices`: a
    `choices` column of each row's own two one-token options (`row_choices`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fields = [("id", pa.int64()), ("tokens", pa.list_(pa.int32()))]
    schema = pa.schema(fields + ([("choices", pa.list_(pa.list_(pa.int32())))] if choices else []))
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, chunk):
            ids = np.arange(start, min(start + chunk, rows))
            tokens = token_rows(ids, rows, group_size, prefix_len, distinct_len, seed, changed_every)
            columns = {"id": pa.array(ids), "tokens": _lists(tokens)}
            if choices:
                options = _lists(row_choices(ids).reshape(-1, 1))  # [2N] one-token options
                columns["choices"] = pa.ListArray.from_arrays(pa.array(np.arange(0, 2 * len(ids) + 1, 2, dtype=np.int32)),
                                                              options)
            writer.write_table(pa.table(columns, schema=schema), row_group_size=chunk)


def _lists(values: np.ndarray):
    """[N, K] int32 as an Arrow list<int32> of N rows of K values."""
    import pyarrow as pa

    return pa.ListArray.from_arrays(pa.array(np.arange(0, values.size + 1, values.shape[1], dtype=np.int32)),
                                    pa.array(values.reshape(-1).astype(np.int32)))


def row_choices(ids: np.ndarray) -> np.ndarray:
    """[N, 2] each row's two option tokens: one of 997 × 991 pairs (rows share option sets, as the
    questions of an evaluation do, and neighbours differ)."""
    return np.stack((40_000 + ids % 997, 41_000 + ids % 991), axis=1).astype(np.int32)


def write_batch_input(path: Path, rows: int, group_size: int, words: int, seed: int, chunk: int = 100_000) -> None:
    """OpenAI Batch API lines (chat/completions): a document as the system message, asked
    `group_size` questions (lines of one document apart in the file), each line `row-<i>`."""
    with open(path, "w") as handle:
        for start in range(0, rows, chunk):
            ids = np.arange(start, min(start + chunk, rows))
            texts, asked = document_texts(ids, rows, group_size, words, seed)
            handle.writelines(json.dumps({
                "custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": "smollm2-135m-instruct", "messages": [
                    {"role": "system", "content": f"Article: {text}"},
                    {"role": "user", "content": f"{QUESTIONS[q % len(QUESTIONS)]} Answer Yes or No."}]},
            }) + "\n" for i, text, q in zip(ids.tolist(), texts, asked.tolist()))


def token_rows(ids: np.ndarray, rows: int, group_size: int, prefix_len: int, distinct_len: int,
               seed: int, changed_every: int = 0) -> np.ndarray:
    """[len(ids), P + D] the tokens of input rows `ids`: their group's prefix (the group of a row:
    a fixed shuffle of the rows, `shuffled`) then tokens of their own, each a hash of (seed, group
    or row, position): any row's tokens without generating the others. `changed_every` k > 0:
    rows whose id is a multiple of k get other tokens of their own (an edited row)."""
    groups = shuffled(ids, rows) // group_size
    prefix = _mix(np.uint64(seed) * np.uint64(1 << 40) + groups[:, None].astype(np.uint64) * np.uint64(prefix_len)
                  + np.arange(prefix_len, dtype=np.uint64))
    edited = (ids % changed_every == 0).astype(np.uint64) if changed_every else np.zeros(len(ids), np.uint64)
    own = _mix(np.uint64(seed) * np.uint64(1 << 40) + np.uint64(1 << 62) + edited[:, None] * np.uint64(1 << 61)
               + ids[:, None].astype(np.uint64) * np.uint64(distinct_len) + np.arange(distinct_len, dtype=np.uint64))
    return (np.concatenate((prefix, own), axis=1) % np.uint64(49152)).astype(np.int32)


def shuffled(ids: np.ndarray, rows: int) -> np.ndarray:
    """A fixed permutation of 0..rows-1 evaluated at `ids` (multiplication by a number coprime
    to `rows`): the rows of one document lie apart in the input, as in a real table."""
    step = next(a for a in range(2654435761, 2654435761 + 1000) if np.gcd(a, rows) == 1)
    return (ids.astype(np.int64) * (step % rows)) % rows if rows > 1 else ids.astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a well-spread uint64 hash of each uint64."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def document_texts(ids: np.ndarray, rows: int, group_size: int, words: int, seed: int,
                   vocabulary=DOCUMENT_WORDS) -> tuple[list[str], np.ndarray]:
    """(each row's document text, its question index within its document) for input rows `ids`:
    documents of `words` words drawn from `vocabulary`, `group_size` rows each, rows of one
    document apart in the input (`shuffled`)."""
    vocabulary = np.array(vocabulary)
    position = shuffled(ids, rows)
    docs = position // group_size
    picks = _mix(np.uint64(seed) * np.uint64(1 << 40) + docs[:, None].astype(np.uint64) * np.uint64(words)
                 + np.arange(words, dtype=np.uint64)) % np.uint64(len(vocabulary))
    return [" ".join(row) for row in vocabulary[picks.astype(np.int64)].tolist()], position % group_size


def write_text_input(path: Path, rows: int, group_size: int, words: int, seed: int, chunk: int = 200_000) -> None:
    """Text prompts: documents of `words` words, each asked `group_size` questions (rows of one
    document apart in the file, as rows of a real table usually are)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("id", pa.int64()), ("document", pa.string()), ("question", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, chunk):
            ids = np.arange(start, min(start + chunk, rows))
            text, asked = document_texts(ids, rows, group_size, words, seed)
            questions = [QUESTIONS[q % len(QUESTIONS)] for q in asked.tolist()]
            writer.write_table(pa.table({"id": pa.array(ids), "document": text, "question": questions}, schema=schema))


VARIANTS = ("labels", "choices", "openai_batch")  # what a row asks: two labels, its own choices, a Batch line


def job_dict(source: Path, output, text: bool, part_rows: int, incremental: bool = False,
             calibrate: bool = False, variant: str = "labels") -> dict:
    """The benchmark's job: two labels, parts by rows only, no exactness audit (the stand-in's
    scores are not the model's), no compile decision (no model runs); `calibrate`: batch
    calibration and margin confidence, fitted over every row's scores; `variant` "choices": each
    row's own two options (its `choices` column) instead of labels, "openai_batch": Batch API lines
    in and out."""
    job = {"labels": ["Yes", "No"], "model": "smollm2-135m-instruct",
           "engine": {"kind": "torch", "compile": False},
           "output": {"path": str(output), "part_seconds": 1e9, "part_rows": part_rows, "audit_rows": 0,
                      "mode": "incremental" if incremental else "full"}}
    if calibrate:
        job["score"] = {"calibrate": "batch", "confidence": "margin"}
    if variant == "openai_batch":
        job["input"] = {"path": str(source), "format": "openai_batch"}
    elif text:
        job["input"] = {"path": str(source), "id_column": "id"}
        job["prompt"] = {"template": "Article: {document}\n\nQuestion: {question} Answer Yes or No.\nAnswer:"}
    else:
        job["input"] = {"path": str(source), "token_ids_column": "tokens", "id_column": "id"}
    if variant == "choices":
        del job["labels"]
        job["input"]["choices_column"] = "choices"
    return job


# ------------------------------------------------------------------ the child: one `run_job`


def child_run(job_path: str, stats_path: str) -> None:
    """Run the job once with the stand-in engine, saving the stage table to `stats_path` as
    each stage ends (and the run's summary at the end)."""
    from batchscore.bench.standin import HashScores
    from batchscore.jobfile import config_from_dict
    from batchscore.run.runner import run_job
    from batchscore.run.stages import listen

    stats: dict = {"stages": {}}
    saving = threading.Lock()  # the meter's thread saves too

    def save(stages) -> None:
        with saving:
            stats["stages"] = stages
            Path(stats_path + ".tmp").write_text(json.dumps(stats))
            os.replace(stats_path + ".tmp", stats_path)

    meter = StageMeter(on_change=save)
    meter.enter("open")
    config = config_from_dict(json.loads(Path(job_path).read_text()))
    engines: list[HashScores] = []

    def stand_in(resolved, model_dir, engine_section) -> HashScores:
        engines.append(HashScores())
        return engines[-1]

    with listen(meter.enter):
        summary = run_job(config, progress=False, engine_factory=stand_in)
    stats["summary"] = {"rows": summary.rows, "rows_ok": summary.rows_ok, "resumed_rows": summary.resumed_rows,
                        "logical_tokens": summary.logical_tokens, "saving_ratio": summary.saving_ratio,
                        "groups_scored": sum(e.groups for e in engines), "rows_scored": sum(e.rows for e in engines),
                        "rows_carried": summary.carry.carried, "rows_dropped": summary.carry.dropped,
                        "rows_planned": summary.carry.scored}
    save(meter.close())


def run_child(job: Path, stats: Path, fault: str | None) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("BATCHSCORE_FAULT", None)
    if fault:
        env["BATCHSCORE_FAULT"] = fault
    command = [sys.executable, "-m", "batchscore.bench.scale_bench", "--child", str(job), str(stats)]
    return subprocess.run(command, env=env).returncode


# ------------------------------------------------------------------ checks and the table


def read_output(output, variant: str):
    """(ids, first option's probability, statuses, calibrated columns or None) of a finished output:
    Parquet (local or in an object store) or Batch API lines (`row-<i>` custom ids)."""
    import pyarrow.parquet as pq

    from batchscore.io.storage import as_path

    if variant == "openai_batch":
        ids, p, status = [], [], []
        with open(output) as lines:
            for line in lines:
                record = json.loads(line)
                ids.append(int(record["custom_id"].removeprefix("row-")))
                body = record["response"]["body"]
                p.append(body["scores"]["Yes"])
                status.append("ok" if record["response"]["status_code"] == 200 else "error")
        return np.array(ids), np.array(p), status, None
    with as_path(output).open("rb") as handle:
        names = pq.read_schema(handle).names
        handle.seek(0)
        first = "p_choices" if variant == "choices" else "p_Yes"
        calibrated = [c for c in ("p_cal_Yes", "confidence") if c in names]
        table = pq.read_table(handle, columns=["id", first, "status"] + calibrated)
    column = table.column(first)
    p = (np.array([values[0] for values in column.to_pylist()]) if variant == "choices"
         else column.to_numpy())
    return (table.column("id").to_numpy(), p, table.column("status").to_pylist(),
            {c: table.column(c) for c in calibrated} or None)


def check_output(output, source: Path, rows: int, text: bool, args: dict, changed_every: int = 0,
                 variant: str = "labels") -> str:
    """Every input row once, in input order, scored, with the stand-in's score for its tokens
    (token inputs: the first 20,000 rows recomputed from their tokens). Raises AssertionError."""
    from batchscore.bench.standin import expected_p_first

    ids, p, status, calibrated = read_output(output, variant)
    assert len(ids) == rows, f"the output holds {len(ids)} rows for {rows} input rows"
    if calibrated:
        assert all(column.null_count == 0 for column in calibrated.values()), \
            "a scored row without its calibrated probability or confidence"
    assert np.array_equal(ids, np.arange(rows)), "the output's ids are not every input row once, in input order"
    assert status.count("ok") == rows, "rows not scored"
    if text or variant == "openai_batch":
        return f"{rows:,} rows, each once, in input order, all scored"
    checked = min(rows, 20_000)
    tokens = token_rows(np.arange(checked), rows, **args, changed_every=changed_every)
    expected = np.array([expected_p_first(t) for t in tokens])
    assert np.allclose(p[:checked], expected, rtol=0, atol=1e-12), "a row's score is not its own tokens' score"
    return (f"{rows:,} rows, each once, in input order, all scored; the first {checked:,} rows' scores match "
            "their tokens")


def stage_table(stages: dict, rows: dict, tokens: dict) -> list[str]:
    lines = [f"  {'stage':<10} {'seconds':>9} {'rows/s':>12} {'tokens/s':>13} {'peak RssAnon':>13}"]
    for name, entry in stages.items():
        seconds = entry["seconds"]
        rate = lambda n: f"{n / seconds:,.0f}" if n and seconds > 0 else "-"  # noqa: E731
        lines.append(f"  {name:<10} {seconds:9.1f} {rate(rows.get(name)):>12} {rate(tokens.get(name)):>13} "
                     f"{entry['peak_anon'] / 2**20:10,.0f} MiB")
    return lines


# ------------------------------------------------------------------ plan only


@dataclass
class GeneratedRows:
    """`PlanRows` (plan/metadata.py) over a generated flat token file: rows of equal length, the
    tokens, offsets and row ids memory-mapped (they are not the plan's memory), no options."""

    flat: FlatTokens
    row_ids: np.ndarray
    max_token: int = 49151  # token_rows' ids are below 49152

    def options_at(self, position: int) -> None:
        return None

    def option_counts(self) -> tuple[int, int]:
        return 0, 0


def generated_rows(folder: Path, rows: int, group_size: int, prefix_len: int, distinct_len: int, seed: int,
                   chunk: int = 20_000) -> GeneratedRows:
    """`rows` rows of `token_rows` (bench scale's token input: documents of `group_size` questions,
    `prefix_len` shared tokens then `distinct_len` of their own) written into files in `folder`
    and mapped back: the tokens as uint16, as the token store keeps ids below 65,536, written by
    one process per core (`_write_token_rows`). Small chunks keep token_rows' uint64 temporaries
    in cache (20,000 rows: ~7x faster than 1,000,000)."""
    width = prefix_len + distinct_len
    path = folder / "tokens.u16"
    with open(path, "wb") as handle:
        handle.truncate(rows * width * 2)
    starts = list(range(0, rows, chunk))
    processes = max(1, min(len(os.sched_getaffinity(0)), len(starts)))
    if processes == 1:
        _write_token_rows(path, starts, rows, group_size, prefix_len, distinct_len, seed, chunk)
    else:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(processes) as pool:
            pool.starmap(_write_token_rows, [(path, starts[k::processes], rows, group_size, prefix_len, distinct_len,
                                              seed, chunk) for k in range(processes)])
    offsets = np.lib.format.open_memmap(folder / "offsets.npy", mode="w+", dtype=np.int64, shape=(rows + 1,))
    row_ids = np.lib.format.open_memmap(folder / "row_ids.npy", mode="w+", dtype=np.int64, shape=(rows,))
    for start in range(0, rows + 1, 1 << 20):
        end = min(start + (1 << 20), rows + 1)
        offsets[start:end] = np.arange(start, end, dtype=np.int64) * width
        row_ids[start : min(end, rows)] = np.arange(start, min(end, rows))
    del offsets, row_ids  # flushed; mapped again read-only
    mapped = lambda name: np.load(folder / name, mmap_mode="r")  # noqa: E731
    tokens = np.memmap(path, dtype=np.uint16, mode="r", shape=(rows * width,))
    return GeneratedRows(FlatTokens(tokens, mapped("offsets.npy")), mapped("row_ids.npy"))


def _write_token_rows(path: Path, starts: list[int], rows: int, group_size: int, prefix_len: int, distinct_len: int,
                      seed: int, chunk: int) -> None:
    """Write the chunks of rows beginning at `starts` into the token file, each at its place."""
    width = prefix_len + distinct_len
    with open(path, "r+b") as handle:
        for start in starts:
            ids = np.arange(start, min(start + chunk, rows))
            tokens = token_rows(ids, rows, group_size, prefix_len, distinct_len, seed).astype(np.uint16)
            os.pwrite(handle.fileno(), tokens.tobytes(), start * width * 2)


def plan_only_bench(rows: int, group_size: int, prefix_len: int, distinct_len: int, workers: int,
                    workdir: str | None = None) -> None:
    """Plan `rows` generated rows with `plan_rows` (the planner of every job) and cut the plan into
    `workers` cost-balanced ranges; seconds and peak RssAnon per stage."""
    from batchscore.plan import PlanOptions
    from batchscore.plan.metadata import plan_rows
    from batchscore.run.ranges import cut_ranges

    meter = StageMeter()
    with tempfile.TemporaryDirectory(prefix="batchscore-plan-only-", dir=workdir) as tmp:
        meter.enter("tokens")
        source = generated_rows(Path(tmp), rows, group_size, prefix_len, distinct_len, seed=0)
        meter.enter("checks")  # plan_rows' own stages follow: sort, intervals, enlarge, groups
        plan = plan_rows(source, PlanOptions(min_prefix_tokens=16), on_stage=meter.enter)
        meter.enter("ranges")
        ranges = [end - start for start, end in cut_ranges(plan, workers)]
        stages = meter.close()
    shared = int((plan.prefix_lens > 0).sum())
    click.echo(f"plan only: {rows:,} rows of {prefix_len + distinct_len} tokens (generated, memory-mapped) "
               f"through plan_rows, {len(plan):,} groups ({shared:,} shared), saving ratio "
               f"{plan.stats.saving_ratio:.3f}, {workers} ranges of {min(ranges):,}..{max(ranges):,} groups")
    for line in stage_table(stages, {s: rows for s in stages}, {s: rows * (prefix_len + distinct_len) for s in stages}):
        click.echo(line)
    total = sum(s["seconds"] for s in stages.values())
    click.echo(f"total {total:.1f} s (plan_seconds {plan.stats.plan_seconds:.1f}), "
               f"peak RssAnon {max(s['peak_anon'] for s in stages.values()) / 2**30:.2f} GiB")


# ------------------------------------------------------------------ the command


@click.command("scale")
@click.option("--rows", type=click.IntRange(min=1), default=1_000_000, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=5, show_default=True,
              help="Rows sharing one prefix (questions per document).")
@click.option("--prefix", type=click.IntRange(min=1), default=40, show_default=True,
              help="Shared prefix tokens (token inputs; --text: words per document).")
@click.option("--distinct", type=click.IntRange(min=1), default=8, show_default=True, help="Distinct tokens per row.")
@click.option("--text", is_flag=True, help="Text prompts (documents × questions) tokenized by the built-in model.")
@click.option("--kill/--no-kill", default=True, show_default=True,
              help="SIGKILL the first run after about half its parts, then resume.")
@click.option("--part-rows", type=click.IntRange(min=1), default=20_000, show_default=True)
@click.option("--plan-only", is_flag=True,
              help="Plan N generated token rows (memory-mapped, in --workdir) with plan_rows; no run.")
@click.option("--workers", type=click.IntRange(min=1), default=8, show_default=True, help="--plan-only: ranges cut.")
@click.option("--incremental", type=click.FloatRange(min=0, max=1, min_open=True), default=None,
              help="Then a second night (output.mode incremental) with this share of the rows edited: the rows "
                   "it scores and carries, its peak RssAnon, and its output checked against the rows' tokens.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="Where the input and output go (default: a temporary folder, removed after).")
@click.option("--calibrate", is_flag=True,
              help="The job calibrates (score.calibrate: batch, margin confidence): fitted over every row's scores.")
@click.option("--choices", is_flag=True, help="Each row's own two options (input.choices_column) instead of labels.")
@click.option("--format", "wire", type=click.Choice(["parquet", "openai_batch"]), default="parquet", show_default=True,
              help="openai_batch: OpenAI Batch API lines in and out (chat prompts tokenized by the built-in model).")
@click.option("--output", "output_url", default=None, metavar="s3://BUCKET/KEY",
              help="Write the output to an object store: the project's local S3 test server (moto) is started "
                   "for the run, on this machine.")
@click.option("--child", nargs=2, hidden=True, default=None)
def scale(rows: int, group_size: int, prefix: int, distinct: int, text: bool, kill: bool, part_rows: int,
          plan_only: bool, workers: int, incremental: float | None, workdir: str | None, calibrate: bool,
          choices: bool, wire: str, output_url: str | None, child: tuple[str, str] | None) -> None:
    """N rows through `batchscore run` with a stand-in engine, killed once and resumed; seconds,
    rows/s, tokens/s and peak RssAnon per stage.

    Examples:

        batchscore bench scale --rows 1000000
        batchscore bench scale --rows 200000 --text
        batchscore bench scale --rows 100000000 --plan-only

        batchscore bench scale --rows 1000000 --incremental 0.1
        batchscore bench scale --rows 1000000 --calibrate
        batchscore bench scale --rows 1000000 --choices
        batchscore bench scale --rows 1000000 --output s3://bench/scores.parquet
        batchscore bench scale --rows 1000000 --format openai_batch
    """
    if child:
        child_run(*child)
        return
    if plan_only:
        plan_only_bench(rows, group_size, prefix, distinct, workers, workdir)
        return
    if workdir is not None:
        try:  # a folder that is not there yet is made, as the output's folder of a run is
            Path(workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.BadParameter(f"{workdir}: cannot be made a folder ({exc.strerror or exc})",
                                     param_hint="--workdir") from None
    variant = "choices" if choices else "openai_batch" if wire == "openai_batch" else "labels"
    if choices and wire == "openai_batch":
        raise click.BadParameter("a Batch line asks its labels: leave out --choices", param_hint="--choices")
    if output_url is not None and not output_url.startswith("s3://"):
        raise click.BadParameter("an s3:// URL (the local S3 test server is started for it)", param_hint="--output")
    if output_url is not None and (incremental is not None or variant == "openai_batch"):
        raise click.BadParameter("--output s3://… with a Parquet output, one night", param_hint="--output")
    with tempfile.TemporaryDirectory(prefix="batchscore-scale-", dir=workdir) as tmp, local_s3(output_url):
        _scale(Path(tmp), rows, group_size, prefix, distinct, text, kill, part_rows, incremental, calibrate,
               variant, output_url)


LEASE_SECONDS = 5  # an object-store output's lease in the children: the resume waits this long after the kill


@contextmanager
def local_s3(url: str | None):
    """With an s3:// `url`: moto's S3 server on localhost, in this (the measuring) process, its
    bucket made and its address in the environment the children inherit; else nothing."""
    if url is None:
        yield
        return
    try:
        import s3fs
        from moto import server as moto_server
    except ImportError:
        raise click.ClickException("--output s3://… needs moto and s3fs: pip install 'batchscore[dev]'") from None
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1", "BATCHSCORE_LEASE_SECONDS": str(LEASE_SECONDS)}
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()  # a client made before (another endpoint) is not reused
    try:
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(url[len("s3://"):].split("/")[0])
        click.echo(f"object store: moto's S3 server at {env['AWS_ENDPOINT_URL']}, output {url}")
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def _scale(tmp: Path, rows: int, group_size: int, prefix: int, distinct: int, text: bool, kill: bool,
           part_rows: int, incremental: float | None = None, calibrate: bool = False, variant: str = "labels",
           output_url: str | None = None) -> None:
    from batchscore.io.storage import as_path
    from batchscore.output.layout import OutputFiles

    if incremental is not None and (text or variant != "labels"):
        raise click.BadParameter("--incremental edits token rows of a labels job: leave out --text, --choices "
                                 "and --format", param_hint="--incremental")
    batch = variant == "openai_batch"
    source, job = tmp / ("input.jsonl" if batch else "input.parquet"), tmp / "job.json"
    output = output_url or tmp / ("scores.jsonl" if batch else "scores.parquet")
    args = {"group_size": group_size, "prefix_len": prefix, "distinct_len": distinct, "seed": 0}
    started = time.perf_counter()
    if batch:
        write_batch_input(source, rows, group_size, prefix, seed=0)
    elif text:
        write_text_input(source, rows, group_size, prefix, seed=0)
    else:
        write_token_input(source, rows, **args, choices=variant == "choices")
    kind = "Batch API lines" if batch else "text" if text else "token ids" + (", own choices" if variant == "choices" else "")
    click.echo(f"input: {rows:,} rows ({kind}) written in {time.perf_counter() - started:.1f} s")
    job.write_text(json.dumps(job_dict(source, output, text or batch, part_rows, incremental is not None, calibrate,
                                       variant)))
    parts = -(-rows // part_rows)
    runs = []
    if kill and parts >= 2:
        code = run_child(job, tmp / "killed.json", fault=f"part:{max(1, parts // 2)}")
        if code != -9:
            raise click.ClickException(f"the first run was to be killed (SIGKILL) but exited with {code}")
        manifest = json.loads(as_path(OutputFiles(str(output)).parts / "run.manifest.json").read_text())
        runs.append(("killed", json.loads((tmp / "killed.json").read_text()),
                     sum(p["end"] - p["start"] for p in manifest["parts"])))
        if output_url:
            time.sleep(LEASE_SECONDS + 0.5)  # the killed run's lease ends: a resume may take it over
    code = run_child(job, tmp / "resumed.json", fault=None)
    if code != 0:
        raise click.ClickException(f"the run exited with {code}")
    final = json.loads((tmp / "resumed.json").read_text())
    summary = final["summary"]
    runs.append(("resumed" if runs else "run", final, summary["rows_ok"] - summary["resumed_rows"]))
    checked = check_output(output, source, rows, text, args, variant=variant)
    tokens_per_row = summary["logical_tokens"] / rows
    click.echo(f"rows: {rows:,}  logical tokens: {summary['logical_tokens']:,}  saving ratio: "
               f"{summary['saving_ratio']:.3f}  resumed rows: {summary['resumed_rows']:,}")
    for name, stats, scored in runs:
        every = {"read": rows, "plan": rows, "score": scored, "assemble": rows}  # open, audit: no per-row rate
        click.echo(f"{name} run ({scored:,} rows scored):")
        for line in stage_table(stats["stages"], every, {k: v * tokens_per_row for k, v in every.items()}):
            click.echo(line)
    peak = max(e["peak_anon"] for _, stats, _ in runs for e in stats["stages"].values())
    click.echo(f"peak RssAnon of any run: {peak / 2**30:.2f} GiB")
    click.echo(f"check: {checked}")
    if incremental is not None:
        _second_night(tmp, job, source, output, rows, args, incremental)


def _second_night(tmp: Path, job: Path, source: Path, output: Path, rows: int, args: dict, share: float) -> None:
    """The next night: every k-th row edited (k = 1 / share), the job run again incrementally."""
    every = max(1, round(1 / share))
    started = time.perf_counter()
    write_token_input(source, rows, **args, changed_every=every)
    edited = -(-rows // every)
    click.echo(f"second night: {edited:,} of {rows:,} rows edited, input written in {time.perf_counter() - started:.1f} s")
    code = run_child(job, tmp / "night2.json", fault=None)
    if code != 0:
        raise click.ClickException(f"the second night exited with {code}")
    night = json.loads((tmp / "night2.json").read_text())
    summary = night["summary"]
    click.echo(f"second night: {summary['rows_planned']:,} rows scored, {summary['rows_carried']:,} carried, "
               f"{summary['rows_dropped']:,} of the first night's dropped (expected {edited:,} scored, "
               f"{rows - edited:,} carried)")
    every_rows = {"read": rows, "plan": rows - summary["rows_carried"], "score": summary["rows_planned"],
                  "assemble": rows}
    tokens_per_row = summary["logical_tokens"] / max(rows - summary["rows_carried"], 1)
    for line in stage_table(night["stages"], every_rows, {k: v * tokens_per_row for k, v in every_rows.items()}):
        click.echo(line)
    peak = max(e["peak_anon"] for e in night["stages"].values())
    click.echo(f"second night's peak RssAnon: {peak / 2**30:.2f} GiB")
    if summary["rows_planned"] != edited or summary["rows_carried"] != rows - edited:
        raise click.ClickException("the second night did not score exactly the edited rows")
    click.echo(f"check: {check_output(output, source, rows, False, args, every)} (the edited rows' new tokens)")


if __name__ == "__main__":
    scale()
