"""Static shards read their rows from one token store for the whole set.

A static shard (`--shard I/N`) is an independent process, maybe on another machine, with no
coordinator: to find its share it needs the whole job's plan, so it needs every row's tokens.
The token store lets the set do that work once: the set's store lives in the parts folder beside
the shards' parts (`_<output>.parts/tokens`, as a one-process run's does). A shard that finds a
complete store of the same content there reuses it (no tokenizing); otherwise it tokenizes into a
folder of its own and publishes it by renaming it into place, and a shard that loses that race
drops its copy and reads the winner's. Shards started together therefore each tokenize (as
before the store), shards started later (or a `run` of one of them resumed) do not. Each shard
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
from pathlib import Path

from batchscore.io.storage import remove_tree
from batchscore.store.build import build_store
from batchscore.store.tokens import TokenStore

log = logging.getLogger("batchscore")


def set_store(source, folder, writer: str, progress=None):
    """(PreparedJob, TokenStore): the shard set's store in `folder` (the parts folder's `tokens`,
    or a local folder of the job's identity), reused when complete and of this content, else built
    in a folder of this writer's beside it and published (`progress(n)`: rows read). A refused input
    leaves no folder of this shard's behind."""
    folder = Path(folder)
    if TokenStore.reusable(folder, source.identity) is not None:
        return build_store(source, folder, progress)  # reused: no tokenizing
    private = folder.with_name(f"{folder.name}.{writer}")
    existed = folder.parent.exists()
    try:
        job, _ = build_store(source, private, progress)  # a resumed shard may reuse its own unpublished copy
    except BaseException:
        remove_tree(private)
        if not existed:
            _remove_if_empty(folder.parent)
        raise
    return job, _publish(private, folder, source.identity, writer)


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
