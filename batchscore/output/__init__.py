"""Everything about an output: its files and columns (`layout.py`), the one normalization of
label scores (`scores.py`), the table (`table.py`; its wire formats are formats/), parts and the
manifest (`parts.py`), the lock and lease (`lock.py`, `lease.py`), the run identity
(`identity.py`) and the Prometheus file (`prometheus.py`). A face only: it imports nothing."""
