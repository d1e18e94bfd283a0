"""The `batchscore` command line: thin commands that parse, call the library and report."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import click

from batchscore import __version__
from batchscore.errors import EXIT_CONFIG, EXIT_INTERRUPTED, BatchscoreError


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _load(job: str, sets: tuple[str, ...], output: str | None = None, allow_code: bool = False):
    from batchscore.config import load_job, parse_set_options

    return load_job(job, parse_set_options(sets), output=output, allow_code=allow_code)


@contextmanager
def _run_files_on_every_exit(metrics: str | None, metrics_prom: str | None, report: bool, job: str):
    """Write `run`'s --metrics JSON and --metrics-prom file however the run ends: the summary with
    `status: ok`, or the error, its exit code and (after an error-rate failure) the summary. With
    --report, the HTML report of a written output (also after an error-rate failure). Yields a
    function that records the summary of a run that ended well and returns the report's path."""
    from batchscore.io.atomic import atomic_write

    def write(data: dict) -> None:
        if metrics:
            atomic_write(metrics, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2)))
        if metrics_prom:
            from batchscore.output.prometheus import write_prometheus

            write_prometheus(data, metrics_prom, job=job)

    def write_report(summary) -> Path | None:
        if not (report and summary is not None and summary.complete):
            return None
        from batchscore.report import write_report as write_html

        return write_html(summary.output_path, metrics=summary.to_dict())

    def ok(summary) -> Path | None:
        path = write_report(summary)  # a report that cannot be written fails the run, recorded below
        write({"status": "ok", "exit_code": 0, **summary.to_dict()})
        return path

    try:
        yield ok
    except BatchscoreError as exc:
        summary = getattr(exc, "summary", None)
        write({"status": "failed", "exit_code": exc.exit_code, "error": str(exc),
               **(summary.to_dict() if summary is not None else {})})
        try:  # the output was written (error rate): its report matters most now
            path = write_report(summary)
        except BatchscoreError as report_exc:
            click.echo(f"warning: no report: {report_exc}", err=True)
        else:
            if path:
                click.echo(f"report: {path}", err=True)
        raise
    except KeyboardInterrupt:
        write({"status": "failed", "exit_code": EXIT_INTERRUPTED, "error": "interrupted"})
        raise
    except Exception as exc:
        write({"status": "failed", "exit_code": 1, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _guarded(fn):
    """Map the library's exceptions to clear one-paragraph messages and documented exit codes."""
    from functools import wraps

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BatchscoreError as exc:
            _fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            _fail("interrupted", EXIT_INTERRUPTED)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchscore")
@click.option("-v", "--verbose", is_flag=True, help="Log what each stage decides.")
def main(verbose: bool) -> None:
    """Score every row of a prompt batch with an LLM: P(label) per row, written to Parquet.

    Example:

        batchscore run jobs/sample.yaml --output scores.parquet
    """
    # A file-size limit (ulimit -f) then fails a write with EFBIG, reported and resumable,
    # instead of killing the process with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not verbose:  # vLLM logs every start-up and shutdown step at INFO; keep the terminal readable
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from batchscore.engines.cpu_features import configure_openmp_wait

    configure_openmp_wait()  # before torch loads: idle threads spin briefly, then yield the core


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set engine.dtype=bfloat16 (repeatable).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Override output.path.")
@click.option("--metrics", type=click.Path(dir_okay=False), help="Write a JSON run summary here.")
@click.option("--metrics-prom", type=click.Path(dir_okay=False),
              help="Write the run summary for Prometheus (node-exporter textfile collector; name it *.prom).")
@click.option("--report", "report", is_flag=True,
              help="After a complete run, write <output>.report.html (see `batchscore report`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--fresh", is_flag=True, help="Discard a partial earlier run of this output and start over.")
@click.option("--shard", metavar="I/N", help="Score only static shard I of N (e.g. one Airflow task each); "
              "the shard that completes the set writes the output, or run `batchscore merge`.")
@click.option("--allow-code", is_flag=True, help="Allow engine.vllm_args that make vLLM load code "
              "(trust_remote_code, worker_extension_cls, ...); off: a job file cannot run code.")
@_guarded
def run(job: str, sets: tuple[str, ...], output: str | None, metrics: str | None, metrics_prom: str | None,
        report: bool, quiet: bool, fresh: bool, shard: str | None, allow_code: bool) -> None:
    """Run a scoring job: read, plan, score, write one output row per input row.

    Progress is saved in parts next to the output; if the run dies, the same command resumes it.

    Example:

        batchscore run jobs/sample.yaml --set engine.dtype=bfloat16 -o scores.parquet
    """
    from batchscore.run.runner import Shard, run_job

    try:
        parsed_shard = Shard.parse(shard) if shard else None
    except ValueError as exc:
        _fail(str(exc), EXIT_CONFIG)
    if quiet:
        os.environ.setdefault("TQDM_DISABLE", "1")  # also the model loader's bars
    with _run_files_on_every_exit(metrics, metrics_prom, report, job=Path(job).stem) as record:
        if report:
            from batchscore.report import require_matplotlib

            require_matplotlib()  # before the run, not after hours of scoring
        config = _load(job, sets, output, allow_code=allow_code)
        summary = run_job(config, progress=not quiet, fresh=fresh, shard=parsed_shard)
        report_path = record(summary)
    if summary.skipped:
        click.echo(f"{summary.output_path} is already the complete output of this job (same configuration, "
                   "input, model and software): nothing to do. Use --fresh to score it again."
                   + (f"\nreport: {report_path}" if report_path else ""))
        return
    if not summary.complete:
        click.echo(f"shard {shard} done; the output is written when every shard has finished "
                   f"(or run: batchscore merge {job} --shards {parsed_shard.count})")
        return
    click.echo(
        f"wrote {summary.output_path}: {summary.rows_ok} rows ok, {summary.rows_error} errors\n"
        f"tokens: {summary.logical_tokens:,} logical, {summary.processed_tokens:,} processed "
        f"(saving {summary.saving_ratio:.1%})\n"
        f"time: {summary.seconds:.1f} s ({summary.rows_per_second:.1f} rows/s), engine {summary.engine}"
        + (f"\nreport: {report_path}" if report_path else "")
    )


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job key (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@_guarded
def plan(job: str, sets: tuple[str, ...], as_json: bool) -> None:
    """Plan a job without scoring: prefix groups, token counts and saving ratios.

    Example:

        batchscore plan jobs/table3_a.yaml --json
    """
    from batchscore.prepare.job import plan_job

    config = _load(job, sets)
    plan = plan_job(config)
    stats = plan.stats.to_dict()
    if config.engine.speculative is not None:  # main-model tokens (and FLOPs) with and without dropping
        from batchscore.engines.speculative.kept_tokens import plan_drop_stats
        from batchscore.models import resolve_model

        stats.update(plan_drop_stats(plan.groups, config.engine.speculative, resolve_model(config.model),
                                     len(config.labels)).to_dict())
    if as_json:
        click.echo(json.dumps(stats))
        return
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        click.echo(f"{key:<{width}}  {shown}")


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--shards", type=click.IntRange(min=1), required=True, help="N, the number of static shards.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job key (repeatable).")
@click.option("--output", "-o", type=click.Path(dir_okay=False), help="Override output.path.")
@_guarded
def merge(job: str, shards: int, sets: tuple[str, ...], output: str | None) -> None:
    """Combine the parts of N finished static shards into the output.

    Example:

        batchscore run job.yaml --shard 0/2 && batchscore run job.yaml --shard 1/2
        batchscore merge job.yaml --shards 2
    """
    from batchscore.run.runner import merge_shards

    summary = merge_shards(_load(job, sets, output), shards)
    if summary is None:
        click.echo("nothing to merge: the output was already written by the last shard")
        return
    click.echo(f"wrote {summary.output_path}: {summary.rows_ok} rows ok, {summary.rows_error} errors")


@main.command()
@click.argument("output", type=click.Path(dir_okay=False))
@click.option("--previous", type=click.Path(dir_okay=False),
              help="An earlier output of the same job: adds label flips, PSI per label and the rows that changed most.")
@click.option("--metrics", type=click.Path(dir_okay=False),
              help="The run's --metrics JSON (default: one next to OUTPUT that names it).")
@click.option("--id-column", help="Join OUTPUT and --previous on this column (default: the first column).")
@click.option("--html", "-o", "html", type=click.Path(dir_okay=False),
              help="Where to write the HTML (default: <OUTPUT>.report.html).")
@_guarded
def report(output: str, previous: str | None, metrics: str | None, id_column: str | None, html: str | None) -> None:
    """Write one self-contained HTML report on an output: labels, P(label), label_mass, errors,
    throughput, and drift against a previous output.

    Example:

        batchscore report out/2026-01-02.parquet --previous out/2026-01-01.parquet
    """
    from batchscore.report import write_report

    path = write_report(output, previous=previous, metrics=metrics, html_path=html, id_column=id_column)
    click.echo(f"wrote {path}")


class _BenchGroup(click.Group):
    """`batchscore bench WORKLOAD...` runs the throughput suite; named tools are subcommands.

    The benchmark commands live in `batchscore.bench` (a leaf: no production module imports it)
    and are loaded only when `batchscore bench` runs.
    """

    def _load(self) -> None:
        if not self.commands:
            from batchscore.bench.cli import COMMANDS

            for command in COMMANDS:
                self.add_command(command)

    def list_commands(self, ctx):
        self._load()
        return super().list_commands(ctx)

    def get_command(self, ctx, name):
        self._load()
        return super().get_command(ctx, name)

    def parse_args(self, ctx, args):
        self._load()
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            args = ["workloads", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_BenchGroup)
def bench() -> None:
    """Benchmarks: BatchLLM throughput tables (WORKLOAD...), and named tools.

    Example:

        batchscore bench micro-2000-200 --scale ci

        batchscore bench ci --scale ci --out bench_results
    """


@main.command()
def models() -> None:
    """List the built-in model names.

    Example:

        batchscore models
    """
    from batchscore.models import BUILTIN_MODELS

    for model in BUILTIN_MODELS.values():
        click.echo(f"{model.name}\t{model.description}")


@main.command()
@click.option("--out", "-o", type=click.Path(dir_okay=False), help="Write it to this file instead of stdout.")
def schema(out: str | None) -> None:
    """Print the job file's JSON Schema (for editor completion and CI checks of job files).

    Example:

        batchscore schema -o job.schema.json
    """
    from batchscore.schema import job_schema

    text = json.dumps(job_schema(), indent=2) + "\n"
    if out is None:
        click.echo(text, nl=False)
    else:
        Path(out).write_text(text, encoding="utf-8")
        click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
