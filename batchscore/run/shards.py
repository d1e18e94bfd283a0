"""Static shards read their rows from one token store for the whole set.

A static shard (`--shard I/N`) is an independent process, maybe on another machine, with no
coordinator: to find its share it needs the whole job's plan, so it needs every row's tokens.
The token store lets the set do that work once: the set's store lives in the parts folder beside
the shards' parts (`_<output>.parts/tokens`, as a one-process run's does). A shard that finds a
complete store of the same content there reuses it (no tokenizing); otherwise it claims the build
(`tokens.building`, created exclusively and refreshed every few seconds while it tokenizes into a
folder of its own), publishes the store by renaming it into place and drops the claim. A shard
that finds the build claimed waits for the store instead of tokenizing the same rows again; a
claim not refreshed for CLAIM_STALE_SECONDS belongs to a builder that died, and the next shard
takes it over. Shards started together therefore tokenize the set's rows once. Each shard
then plans from the store (a few integers a row), takes its share with the placement every shard
computes alike (run/ranges.place_shares) and scores it, reading its rows memory-mapped.

On several machines the parts folder must be on a file system they all mount (as the parts
already had to be, for the shard that completes the set to assemble the output) — or in an object
store: then each machine keeps the set's store in a local folder named by the job's identity
(run/runner.token_folder; a memory map needs a local file), shards on one machine share it by
the same publish-by-rename, and the parts go to the object store as before.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path

from batchscore.io.storage import remove_tree
from batchscore.store.build import build_store, reused_store
from batchscore.store.tokens import TokenStore

log = logging.getLogger("batchscore")


CLAIM_STALE_SECONDS = 60.0  # a build claim not refreshed for this long: its shard died, another builds
CLAIM_REFRESH_SECONDS = 5.0
WAIT_POLL_SECONDS = 0.5


def set_store(source, folder, writer: str, progress=None):
    """(PreparedJob, TokenStore): the shard set's store in `folder` (the parts folder's `tokens`,
    or a local folder of the job's identity), reused when complete and of this content; else, when
    another shard is building it, waited for; else built in a folder of this writer's beside it
    and published (`progress(n)`: rows read). A refused input leaves no folder of this shard's behind."""
    folder = Path(folder)
    claim = folder.with_name(f"{folder.name}.building")
    existed = folder.parent.exists()  # before the claim makes it: a refused input leaves none behind
    waited = False
    while True:
        store = TokenStore.reusable(folder, source.identity)
        if store is not None:
            return reused_store(source, store, progress), store  # no tokenizing, the store verified once
        if _claim(claim, writer):
            break
        if not waited:
            log.info("%s: another shard (%s) is tokenizing the set's rows; waiting for its store", writer,
                     _holder(claim))
            waited = True
        _wait_while_claimed(claim)
    try:
        return _build(source, folder, writer, progress, claim, existed)
    finally:
        _release(claim, writer)
        if not existed:
            _remove_if_empty(folder.parent)


def _build(source, folder: Path, writer: str, progress, claim: Path, existed: bool):
    """Tokenize into this writer's own folder (refreshing `claim` meanwhile) and publish it."""
    private = folder.with_name(f"{folder.name}.{writer}")
    stop = threading.Event()
    refresher = threading.Thread(target=_refresh, args=(claim, stop), daemon=True)
    refresher.start()
    try:
        job, _ = build_store(source, private, progress)  # a resumed shard may reuse its own unpublished copy
    except BaseException:
        remove_tree(private)
        raise
    finally:
        stop.set()
        refresher.join()
    return job, _publish(private, folder, source.identity, writer)


def _claim(claim: Path, writer: str) -> bool:
    """Whether this writer now holds the build claim: created exclusively, or taken over from a
    builder that stopped refreshing it."""
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        age = time.time() - claim.stat().st_mtime
    except FileNotFoundError:
        age = None
    if age is not None and age > CLAIM_STALE_SECONDS:
        log.warning("%s: the build claim of %s was last refreshed %.0f s ago; taking it over", writer,
                    _holder(claim), age)
        _remove_if_there(claim)
    try:
        with open(claim, "x") as handle:
            handle.write(f"{writer} pid {os.getpid()} on {socket.gethostname()}\n")
        return True
    except FileExistsError:
        return False


def _wait_while_claimed(claim: Path) -> None:
    """Sleep until the claim is gone (its builder published the store, or failed) or stale."""
    while True:
        try:
            if time.time() - claim.stat().st_mtime > CLAIM_STALE_SECONDS:
                return
        except FileNotFoundError:
            return
        time.sleep(WAIT_POLL_SECONDS)


def _refresh(claim: Path, stop: threading.Event) -> None:
    while not stop.wait(CLAIM_REFRESH_SECONDS):
        try:
            os.utime(claim)
        except FileNotFoundError:
            return


def _release(claim: Path, writer: str) -> None:
    """Drop this writer's claim (left alone when another shard took it over meanwhile)."""
    if _holder(claim).split(" ")[0] == writer:
        _remove_if_there(claim)


def _holder(claim: Path) -> str:
    try:
        return claim.read_text().strip() or "a shard"
    except OSError:
        return "a shard"


def _remove_if_there(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _publish(private: Path, folder: Path, identity: dict, writer: str) -> TokenStore:
    """Rename `private` to `folder`; if another shard's store of the same content is there
    already, keep that one. A store of other content there (an earlier job's) is set aside first."""
    for _ in range(3):
        try:
            os.rename(private, folder)  # atomic; refused when `folder` holds files
            log.info("tokenized the shard set's rows into %s", folder)
            return TokenStore.open(folder)
        except OSError:
            theirs = TokenStore.reusable(folder, identity)
            if theirs is not None:
                remove_tree(private)
                return theirs
            stale = folder.with_name(f"{folder.name}.stale.{writer}")
            try:
                os.rename(folder, stale)
            except OSError:
                pass  # gone meanwhile: try again
            remove_tree(stale)
    raise OSError(f"could not put the token store in place at {folder}")


def _remove_if_empty(folder) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass
