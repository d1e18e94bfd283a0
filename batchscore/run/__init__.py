"""Running a prepared, planned job: `runner.py` (run_job, merge_shards), executors in this
process (`local.py`) or on Ray (`ray.py`), and `sinks.py`, where both hand their results.
A face only: it imports nothing."""
