"""Everything about an output's files and their durability: its files and columns
(`layout.py`), the table (`table.py`; its wire formats are formats/), parts and the manifest
(`parts.py`) and the raw scores they give back (`raw_scores.py`), the lock and lease (`lock.py`,
`lease.py`), the run identity (`identity.py`), the rule for paths a user asks to write
(`write_paths.py`) and the Prometheus file (`prometheus.py`). Score math (normalization,
calibration, review) lives in scores/. A face only: it imports nothing."""
