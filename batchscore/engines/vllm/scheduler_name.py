"""The group-aware scheduler's name and request tag, without importing vLLM (the scheduler
itself, `scheduler.py`, is imported by vLLM's engine-core process only)."""

SCHEDULER = "batchscore.engines.vllm.scheduler.GroupAwareScheduler"
GROUP_KEY = "batchscore_group"  # extra_args value: [group number, requests in the group, prefix blocks]
