"""One rule for every file a user tells batchscore to write (`run --metrics`, `--metrics-prom`,
`report --html`, `output.error_path`, and any option to come): it may not be

- an input: the job file, an input file, or a file the next run would read as input (inside the
  input folder with an input suffix, or matching the input glob);
- the output, or anything inside the output's parts folder;
- a file beside the output that the output owns (output/layout.py: its locks, completion
  marker, error file, report, and any `<output name>.*` file), except the one that option writes
  by default (`report` → `_<output>.report.html`, `--metrics` → `<output>.metrics.json`, …).

A path that breaks it is refused before any work with a WritePathError (exit 2) naming both paths;
one that cannot be written (under a plain file, in a read-only folder) with an OutputError (exit 6),
as output.path is.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

from batchscore.errors import OutputError, WritePathError
from batchscore.io.storage import is_remote, is_url
from batchscore.output.layout import OutputFiles, default_error_path

_WILDCARDS = "*?["


def _key(path) -> str:
    """A path as compared here: a local path made absolute, a URL as written (no trailing '/')."""
    if is_remote(path):
        return str(path).rstrip("/")
    return str(Path(os.fspath(path)).expanduser().resolve())


def _inside(path: str, folder: str) -> bool:
    return path.startswith(folder.rstrip("/") + "/") or (os.sep != "/" and path.startswith(folder + os.sep))


@dataclass(frozen=True)
class Protected:
    """The files a path given to write must not be: `output` (and the files it owns) and the inputs.

    inputs: files read (the job file, input files, a report's --previous and --metrics);
    input_path: input.path as configured (a file, a folder or a glob), for files a later run would read;
    read_suffixes: the file suffixes a folder input reads (the caller asks formats/ for them).
    """

    output: OutputFiles | None = None
    inputs: tuple[str, ...] = field(default_factory=tuple)
    input_path: str | None = None
    read_suffixes: tuple[str, ...] = ()

    @classmethod
    def for_job(cls, config, files=(), *, read_suffixes: tuple[str, ...],
                with_error_file: bool = True, output: OutputFiles | None = None) -> Protected:
        """The files of a JobConfig: its job file, input files (`files`, as discovered) and output
        (`output`: the job's OutputFiles, named by the caller; else from the job);
        `read_suffixes`: what a folder input reads (`formats.suffix_formats()`)."""
        if config.output.path:  # without the job's OutputFiles (run/open.output_files): the output alone
            output = output or OutputFiles(os.fspath(config.output.path))
            output = output if with_error_file else OutputFiles(output.output)
        inputs = tuple(str(f) for f in files) + ((config.source,) if config.source else ())
        return cls(output, inputs, None if config.input.synthetic is not None else config.input.path,
                   tuple(read_suffixes))

    def check(self, option: str, path, default=None) -> None:
        """Raise WritePathError when `option` (e.g. '--metrics') names a `path` it may not write;
        `default`: the file that option writes when not given (allowed beside the output)."""
        if path is None:
            return
        if not is_remote(path) and Path(os.fspath(path)).expanduser().is_dir():
            raise WritePathError(f"{option} {path} is a folder; give a file path")
        check_writable(option, path)
        reason = self._reason(_key(path), None if default is None else _key(default))
        if reason is not None:
            raise WritePathError(f"{option} {path} {reason}; choose another path")

    def _reason(self, target: str, default: str | None) -> str | None:
        for source in self.inputs:
            if target == _key(source):
                return f"is an input of this run ({source}); writing it would destroy it"
        read = self._read_as_input(target)
        if read is not None:
            return read
        if self.output is None or target == default:
            return None
        output = _key(self.output.output)
        if target == output:
            return f"is the output ({self.output.output}); writing it would replace the scores"
        if _inside(target, output):  # a partitioned output (output.partition_by) is a folder, replaced whole
            return f"is inside the output folder {self.output.output}, which each write of the output replaces"
        parts = _key(self.output.parts)
        if target == parts or _inside(target, parts):
            return f"is inside the output's parts folder {self.output.parts}, which the run deletes when it ends"
        for owned in self.output.all_siblings():
            if target == _key(owned):
                return f"is a file of the output {self.output.output} ({owned})"
        folder, name = output.rsplit("/", 1) if "/" in output else ("", output)
        if target.startswith(folder + "/") and "/" not in target[len(folder) + 1:]:
            other = target[len(folder) + 1:]
            if other.startswith(name + ".") or other.startswith("." + name + "."):
                return (f"is beside the output {self.output.output} with a name the output's own files "
                        f"use ({name}.*)")
        return None

    def _read_as_input(self, target: str) -> str | None:
        source = self.input_path
        if not source:
            return None
        if any(ch in source for ch in _WILDCARDS):
            pattern = source if is_url(source) else str(Path(source).expanduser().absolute())
            if fnmatch.fnmatch(target, pattern) or fnmatch.fnmatch(target, _key(pattern)):
                return f"matches the input {source}; the next run would read it as input"
            return None
        root = _key(source)
        if target == root:
            return f"is the input {source}; writing it would destroy it"
        is_folder = source.endswith("/") if is_url(source) else Path(root).is_dir()
        if (is_folder or is_url(source)) and _inside(target, root) and target.lower().endswith(self.read_suffixes):
            return f"is inside the input folder {source}; the next run would read it as input"
        return None


def check_writable(option: str, path) -> None:
    """Refuse a local path whose folder cannot be made or written (under a plain file, or a
    read-only folder) with OutputError, as output.path is refused (run/open.py), before any
    work rather than after every row is scored. An object-store path is checked by its write."""
    if is_remote(path):
        return
    out = Path(os.fspath(path)).expanduser()
    folder = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise OutputError(f"{option} {path}: {folder} is a file, not a folder")
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: the folder {folder} is not writable")


REPORT_MARK = b"<!DOCTYPE html>"  # how report/html.py begins a report
METRICS_MARK = b'"exit_code"'  # in every --metrics JSON
PROM_MARK = b"batchscore_exit_code"  # in every --metrics-prom file


def replaceable(path, mark: bytes) -> bool:
    """Whether `path` may be written when its neighbours are unknown (`report` does not know the
    run's inputs; `run` whose job file cannot be read knows neither input nor output): it does not
    exist, or already holds a file of that kind (`mark` near its start). Reads at most 64 KiB."""
    from batchscore.io.storage import as_path

    try:
        with as_path(path).open("rb") as handle:
            return mark in handle.read(1 << 16)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def check_report_path(option: str, path, output, read=()) -> None:
    """Refuse a report path that breaks the rule for `output` (the output reported on), is one of
    the files the report reads (`read`), or is an existing file that is not a report."""
    Protected(OutputFiles(os.fspath(output)), tuple(os.fspath(p) for p in read if p)).check(
        option, path, default=OutputFiles(output).report)  # the report's default path (report/)
    if path is not None and not replaceable(path, REPORT_MARK):
        raise WritePathError(f"{option} {path} exists and is not a batchscore report (the report of {output} "
                             "would replace it); choose another path")


def check_job_write_paths(config, files=(), *, read_suffixes: tuple[str, ...],
                          output: OutputFiles | None = None) -> None:
    """Refuse, before any work, an output that is the job file, and an openai_batch output's error
    file (output.error_path, or its default) that is an input, the output or another file of the
    output (see the module's rule). `files`: the input files (the output itself is checked against
    them and the input folder by run/open.py); `read_suffixes`: what a folder input reads;
    `output`: the job's OutputFiles (run/open.py names them once)."""
    if not config.output.path:
        return
    if config.source and _key(config.output.path) == _key(config.source):
        raise WritePathError(f"output.path {config.output.path} is the job file {config.source}; "
                             "writing it would destroy it; choose another path")
    if output is None or output.errors is None:  # a format without an error file
        return
    path = output.errors
    Protected.for_job(config, files, read_suffixes=read_suffixes, with_error_file=False, output=output).check(
        "output.error_path", path, default=default_error_path(config.output.path))


def check_run_files(config, *, read_suffixes: tuple[str, ...], metrics=None, metrics_prom=None,
                    output: OutputFiles | None = None) -> None:
    """Refuse `run --metrics` / `--metrics-prom` paths that break the rule (before any work), and
    the two naming the same file; `read_suffixes`: what a folder input reads; `output`: the job's
    OutputFiles (run/open.output_files)."""
    protected = Protected.for_job(config, read_suffixes=read_suffixes, output=output)
    protected.check("--metrics", metrics, default=metrics_default(config.output.path))
    protected.check("--metrics-prom", metrics_prom)
    if metrics and metrics_prom and _key(metrics) == _key(metrics_prom):
        raise WritePathError(f"--metrics {metrics} and --metrics-prom {metrics_prom} are the same file; "
                             "give each its own")


def metrics_default(output) -> str | None:
    """`<output>.metrics.json`: where `batchscore report` looks for a run's --metrics beside its output."""
    return None if not output else os.fspath(output) + ".metrics.json"


__all__ = ["Protected", "check_job_write_paths", "check_writable", "check_report_path", "check_run_files", "metrics_default", "replaceable",
           "METRICS_MARK", "PROM_MARK", "REPORT_MARK"]
