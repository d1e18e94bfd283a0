"""`batchscore serve`: an OpenAI-compatible Batch API (`/v1/files`, `/v1/batches`) over the same
planner and engines as `batchscore run`.

`store.py` keeps files and batches durably (SQLite plus blobs under `--state-dir`), `auth.py`
checks the bearer key, `requests.py` sorts a batch's lines into the jobs it runs, `worker.py`
runs one batch at a time through `batchscore run`, and `app.py` holds the HTTP routes.
"""
