"""Running a prepared, planned job: `runner.py` (run_job, merge_shards), executors in this
process (`local.py`) or on Ray (`ray.py`), `sinks.py`, where both hand their results, and
`run_files.py`, the run's metrics, Prometheus file and report, written however it ends.
A face only: it imports nothing."""
