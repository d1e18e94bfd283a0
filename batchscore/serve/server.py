"""Starting `batchscore serve`: check the key and the job settings, open the state, start the
worker, then serve HTTP with uvicorn until SIGTERM/SIGINT (the running batch saves its parts)."""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from batchscore.serve.auth import resolve_key

log = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    state_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "smollm2-135m-instruct"
    served_model_names: list[str] = field(default_factory=list)  # as vLLM's --served-model-name; [] : the model's
    sets: list[str] = field(default_factory=list)
    api_key_file: str | None = None
    no_auth: bool = False
    max_file_mb: int = 200
    max_requests: int = 50_000


def check_job_settings(state_dir: Path, model: str, sets: list[str]) -> None:
    """Refuse `--model`/`--set` the jobs would refuse, and `--set` of what each batch sets
    itself (its input, labels, model and output files), before serving (JobConfigError, exit 2)."""
    from batchscore.errors import JobConfigError
    from batchscore.jobfile import load_job, parse_set_options

    overrides = parse_set_options(sets)
    owned = [key for key in overrides if key.split(".")[0] in ("input", "labels", "model", "questions")
             or key in ("output", "output.path", "output.format", "output.error_path")]
    if owned:
        raise JobConfigError([f"--set {key}: each batch sets this itself (use --model for the model)" for key in owned])
    fd, name = tempfile.mkstemp(prefix=".settings-check.", suffix=".yaml", dir=state_dir)  # new: never through a link
    probe = Path(name)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(yaml.safe_dump({"input": {"path": str(state_dir / "x.jsonl"), "format": "openai_batch"},
                                     "labels": ["Yes", "No"], "model": model,
                                     "output": {"path": str(state_dir / "x.out.jsonl")}}))
    try:
        config = load_job(probe, overrides)
    except JobConfigError as exc:  # said of the options given, not of the probe's file
        raise JobConfigError([f"--model/--set: {problem}" for problem in exc.problems]) from None
    finally:
        probe.unlink(missing_ok=True)
    emulated = emulated_bfloat16(config.engine)
    if emulated:
        raise JobConfigError([f"--set engine.dtype=bfloat16: {emulated}; a server would run every batch in it. "
                              "Serve float32 (the default, engine.dtype auto, picks it on a CPU)"])


def emulated_bfloat16(engine) -> str | None:
    """Why the jobs' engine would run bfloat16 emulated (a CPU without native bfloat16), or None."""
    if engine.dtype != "bfloat16":
        return None
    from batchscore.engines.cpu_features import cpu_bf16
    from batchscore.engines.factory import resolve_engine

    if resolve_engine(engine).device != "cpu" or cpu_bf16().native:
        return None
    return "this CPU has no native bfloat16 (no AVX512-BF16 or AMX; torch emulates it, ~6x slower than float32)"


def served_names(options: ServeOptions) -> list[str]:
    """The names requests may give the model, the first the one shown (vLLM's rule: with
    --served-model-name, those names only; without, the model's own)."""
    from batchscore.errors import JobConfigError

    names = list(dict.fromkeys(n.strip() for n in options.served_model_names))
    if any(not n for n in names):
        raise JobConfigError(["--served-model-name: a name may not be empty"])
    return names or [options.model]


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn, but a SIGTERM is a deliberate stop: after the graceful shutdown (the running
        batch saves its parts) the server exits 0, where uvicorn raises the signal again (143)."""

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # bound: say where, as the first line an operator looks for
                scheme = "https" if self.config.is_ssl else "http"
                log.info("listening on %s://%s:%d", scheme, self.config.host, self.config.port)

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM:
                self.should_exit = True
            else:
                super().handle_exit(sig, frame)

    return Server


def run_server(options: ServeOptions) -> None:
    import uvicorn

    from batchscore.serve.app import Limits, create_app
    from batchscore.serve.store import Store
    from batchscore.serve.worker import Worker, WorkerSettings

    logging.getLogger("batchscore.serve").setLevel(logging.INFO)  # startup, each request, each batch's moves
    key = resolve_key(options.api_key_file, options.no_auth, options.host)
    names = served_names(options)
    state_dir = Path(options.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    store = Store(state_dir)  # first: refused while another server uses this state dir, or its state is damaged
    try:
        check_job_settings(state_dir, options.model, options.sets)
        from batchscore.models import resolve_model

        resolve_model(options.model)  # a model that cannot be found refuses the start, not every batch
    except BaseException:
        store.close()
        raise
    limits = Limits(max_file_bytes=options.max_file_mb * 1024 * 1024, max_requests=options.max_requests)
    worker = Worker(store, WorkerSettings(model=options.model, sets=list(options.sets),
                                          max_requests=options.max_requests, served_names=names))
    app = create_app(store, worker, key, names[0], limits)
    log.info("serving %s as %s; state in %s; %s", options.model, ", ".join(names), state_dir,
             "no API key (127.0.0.1 only)" if key is None else "bearer key required")
    worker.start()
    try:
        _server_class()(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning")).run()
    finally:
        worker.stop()
        store.close()
