"""The token store: a job's prompts read, rendered and tokenized once into memory-mapped arrays
in the run's folder (tokens.py), and what builds it from a job (build.py).

    from batchscore.store import TokenStore
    store = TokenStore.open(folder)          # store.num_rows, store.row_ids, store.lengths
    store.tokens_of(pos); store.options_at(pos); store.request(pos); store.errors
"""

from batchscore.store.tokens import StoreWriter, TokenStore, identity_digest

__all__ = ["StoreWriter", "TokenStore", "identity_digest"]
