"""Speculative Prefill (an approximate, opt-in mode): a small speculator scores token importance
(`speculator.py`), the kept chunks and their positions are chosen in `kept_tokens.py`. A face
only: it imports nothing."""
