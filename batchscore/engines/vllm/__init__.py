"""Plan-driven vLLM: requests sent in the plan's order so each shared prefix is cached once
(`engine.py`), engine arguments sized from the plan (`settings.py`), multi-token options
(`options.py`, `forcing.py`), hybrid prefilling of the MLPs (`hybrid.py`). A face only: importing
it does not import vllm."""
