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
from batchscore.errors import (EXIT_CONFIG, EXIT_ENGINE, EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OUTPUT,
                               BatchscoreError)


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _load(job: str, sets: tuple[str, ...], output: str | None = None, allow_code: bool = False):
    from batchscore.jobfile import load_job, parse_set_options

    return load_job(job, parse_set_options(sets), output=output, allow_code=allow_code)


# Commands whose object-store and file errors are about what they read (exit 3), not what they write (6).
_READING_COMMANDS = ("plan", "report")


def exit_status(exc: BaseException, command: str | None = None) -> tuple[int, str]:
    """The documented exit code and the message for an exception that ended `command` (README,
    errors.py): the library's own errors carry theirs; a third-party error that escaped the
    library is mapped by kind (an object store that cannot be reached, a YAML error, a full
    disk); anything else is a bug, exit 1."""
    from batchscore.io.storage import store_error_types

    if isinstance(exc, BatchscoreError):
        return exc.exit_code, str(exc)
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    reading = command in _READING_COMMANDS
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, store_error_types()):
        return ((EXIT_INPUT, f"the input's object store cannot be reached or refused: {text}") if reading
                else (EXIT_OUTPUT, f"the output's object store cannot be reached or refused: {text}"))
    if _is_yaml_error(exc):
        return EXIT_CONFIG, f"malformed YAML: {text}"
    if isinstance(exc, OSError):
        return (EXIT_INPUT if reading else EXIT_OUTPUT), f"{type(exc).__name__}: {text}"
    if isinstance(exc, MemoryError):
        return EXIT_ENGINE, "out of memory"
    return EXIT_INTERNAL, (f"unexpected {type(exc).__name__}: {text} (a bug in batchscore; "
                           "`batchscore -v` shows where)")


def _is_yaml_error(exc: BaseException) -> bool:
    yaml = sys.modules.get("yaml")
    return yaml is not None and isinstance(exc, yaml.YAMLError)


class _RunFiles:
    """`run`'s --metrics JSON, --metrics-prom file and --report, written however the run ends:
    the summary with `status: ok`, or the error, its exit code and (after an error-rate failure)
    the summary; the report of a written output (also after an error-rate failure). A path that
    may not be written (output/write_paths.py) is refused before the run, and nothing is written."""

    def __init__(self, metrics: str | None, metrics_prom: str | None, report: bool, job: str):
        self.metrics, self.metrics_prom, self.report, self.job = metrics, metrics_prom, report, job
        self.refused = False
        self.checked = False  # against the job's input and output (the job file could be read)

    def check(self, config=None) -> None:
        """Refuse the paths before any work: against the job file alone, or against `config`'s
        input and output. Raises WritePathError; afterwards nothing is written."""
        from batchscore.errors import WritePathError
        from batchscore.output.write_paths import Protected, check_run_files

        try:
            if config is None:
                protected = Protected(inputs=(self.job,))
                protected.check("--metrics", self.metrics)
                protected.check("--metrics-prom", self.metrics_prom)
            else:
                check_run_files(config, metrics=self.metrics, metrics_prom=self.metrics_prom)
                self.checked = True
        except WritePathError:
            self.refused = True
            raise

    def write(self, data: dict) -> None:
        from batchscore.io.atomic import atomic_write
        from batchscore.output.write_paths import METRICS_MARK, PROM_MARK

        if self.refused:
            return
        if self.metrics and self._may_write(self.metrics, METRICS_MARK):
            atomic_write(self.metrics, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2)))
        if self.metrics_prom and self._may_write(self.metrics_prom, PROM_MARK):
            from batchscore.output.prometheus import write_prometheus

            write_prometheus(data, self.metrics_prom, job=Path(self.job).stem)

    def _may_write(self, path: str, mark: bytes) -> bool:
        """A path checked against the job's files, or (the job file could not be read, so its
        input and output are unknown) one that is new or holds an earlier run's metrics."""
        from batchscore.output.write_paths import replaceable

        if self.checked or replaceable(path, mark):
            return True
        click.echo(f"warning: {path} not written: it holds something else, and without a readable job "
                   "file its input and output are unknown", err=True)
        return False

    def write_report(self, summary) -> Path | None:
        if not (self.report and summary is not None and summary.complete):
            return None
        from batchscore.report import write_report as write_html

        return write_html(summary.output_path, metrics=summary.to_dict())

    def ok(self, summary) -> Path | None:
        """Record a run that ended well; returns the report's path (None without --report)."""
        path = self.write_report(summary)  # a report that cannot be written fails the run, recorded below
        self.write({"status": "ok", "exit_code": 0, **summary.to_dict()})
        return path
def _time_split(summary) -> str:
    """Where a run's wall time went: plan (read, tokenize, plan), scoring, write, audit."""
    audit = (f"audit {summary.audit_seconds:.1f} s ({summary.audit_seconds / summary.seconds:.1%} of the run, "
             f"{summary.audit_rows} rows)" if summary.audit_rows and summary.seconds > 0 else "audit off")
    return (f"  plan {summary.prepare_seconds:.1f} s, scoring {summary.score_seconds:.1f} s, "
            f"write {summary.write_seconds:.1f} s, {audit}")



    @contextmanager
    def on_every_exit(self):
        try:
            yield self
        except (Exception, KeyboardInterrupt) as exc:
            code, message = exit_status(exc, "run")
            summary = getattr(exc, "summary", None)
            try:
                self.write({"status": "failed", "exit_code": code, "error": message,
                            **(summary.to_dict() if summary is not None else {})})
            except Exception as write_exc:  # noqa: BLE001 — the run's own error is the one to exit with
                click.echo(f"warning: no metrics written: {exit_status(write_exc, 'run')[1]}", err=True)
            try:  # the output was written (error rate): its report matters most now
                path = self.write_report(summary)
            except Exception as report_exc:  # noqa: BLE001
                click.echo(f"warning: no report: {exit_status(report_exc, 'run')[1]}", err=True)
            else:
                if path:
                    click.echo(f"report: {path}", err=True)
            raise


class _Main(click.Group):
    """The `batchscore` group: every exception that escapes a command (bench included) ends in a
    documented exit code and one `error:` line; the traceback only with `batchscore -v`."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            code, message = exit_status(exc, ctx.invoked_subcommand)
            if ctx.params.get("verbose"):
                import traceback

                traceback.print_exc(file=sys.stderr)
            _fail(message, code)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
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
    files = _RunFiles(metrics, metrics_prom, report, job)
    with files.on_every_exit():
        files.check()  # not over the job file, before it is even read
        if report:
            from batchscore.report import require_matplotlib

            require_matplotlib()  # before the run, not after hours of scoring
        config = _load(job, sets, output, allow_code=allow_code)
        files.check(config)  # not over an input, the output or the output's own files
        summary = run_job(config, progress=not quiet, fresh=fresh, shard=parsed_shard)
        report_path = files.ok(summary)
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
        f"time: {summary.seconds:.1f} s ({summary.rows_per_second:.1f} rows/s), engine {summary.engine}\n"
        f"{_time_split(summary)}"
        + (f"\nreport: {report_path}" if report_path else "")
    )


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job key (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
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
@click.option("--truth", metavar="COLUMN",
              help="OUTPUT's column of true labels, for accuracy, calibration and the confusion matrix "
                   "(default: the run's calibrate.truth_column).")
@click.option("--html", "-o", "html", type=click.Path(dir_okay=False),
              help="Where to write the HTML (default: <OUTPUT>.report.html).")
def report(output: str, previous: str | None, metrics: str | None, id_column: str | None, truth: str | None,
           html: str | None) -> None:
    """Write one self-contained HTML report on an output: labels and their prevalence, P(label),
    label_mass, quality against true labels, the exactness audit, errors, throughput, and drift
    against a previous output (with tests).

    Example:

        batchscore report out/2026-01-02.parquet --previous out/2026-01-01.parquet
    """
    from batchscore.output.write_paths import check_report_path
    from batchscore.report import write_report

    check_report_path("--html", html, output, read=(output, previous, metrics))
    path = write_report(output, previous=previous, metrics=metrics, html_path=html, id_column=id_column, truth=truth)
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
