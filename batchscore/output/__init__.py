"""Everything about an output: its files and columns (`layout.py`), the one normalization of
label scores (`scores.py`), the table (`table.py`) and its formats (`formats.py`), parts and the
manifest (`parts.py`), the lock and lease (`lock.py`, `lease.py`), the run identity
(`identity.py`) and the Prometheus file (`prometheus.py`). A face only: it imports nothing."""
