"""Plan-driven vLLM: requests sent in the plan's order so each shared prefix is cached once
(`engine.py`), engine arguments sized from the plan (`settings.py`), multi-token options
(`options.py`, `forcing.py`), hybrid prefilling of every row-wise op (`hybrid.py`) and the peak
read inside vLLM's workers (`worker.py`, methods called by name), group-aware scheduling
(`scheduler.py`). A face only: importing it does not import vllm."""
