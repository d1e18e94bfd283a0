"""A cancelled job's output: what its parts hold, written as `batchscore run` writes a finished
output (the same assembly), with every row no part holds as an error row the server then answers
as cancelled. Run by the worker as a child process, after the job's run has stopped:

    python -m batchscore.serve.partial JOB.yaml [--set KEY=VALUE ...]

Exit 0: written; 1: no parts of this job (nothing was scored; every row is cancelled); 75 (the
output's lock is held: a run still saving) or another code: as `batchscore run`'s."""

from __future__ import annotations

import sys


def write_partial_output(job_path: str, sets: list[str]) -> bool:
    """Write the job's output (and error file) from the parts its stopped run saved; False when
    there are none of this job to write from."""
    from batchscore.jobfile import load_job, parse_set_options
    from batchscore.output.identity import identity_hash
    from batchscore.output.layout import RUN_WRITER
    from batchscore.output.lock import OutputLock
    from batchscore.output.parts import PartStore
    from batchscore.run.open import open_job, prepare_job
    from batchscore.run.runner import assemble_output

    config = load_job(job_path, parse_set_options(sets))
    source = open_job(config)
    files = source.output
    with OutputLock(files, RUN_WRITER) as lock:
        store = PartStore(files, RUN_WRITER, guard=lock.check)
        manifest = store.load_manifest()
        if manifest is None or identity_hash(manifest.identity) != identity_hash(source.identity):
            return False
        job = prepare_job(config, source=source)  # tokenized: the decision lines' usage counts the prompts
        assemble_output(job, store, [manifest])
    return True


def main(argv: list[str]) -> int:
    from batchscore.errors import BatchscoreError

    job_path, sets = argv[0], [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    try:
        return 0 if write_partial_output(job_path, sets) else 1
    except BatchscoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
