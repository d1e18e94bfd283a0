"""The planner: global prefix sharing for a batch of prefill-only requests.

Pure Python + numpy; never imports torch or vllm.

    from batchscore.plan import build_plan, PlanOptions, requests_from_token_lists
    plan = build_plan(requests_from_token_lists(token_lists), PlanOptions(block_size=16))
    for group in plan.groups: ...   # execution order; plan.stats.saving_ratio
"""

from batchscore.plan.cache_sim import PrefixCache, SimResult, simulate, simulate_groups
from batchscore.errors import PlanInputError
from batchscore.plan.planner import Plan, PlanOptions, PlanStats, build_plan
from batchscore.plan.placement import (
    Placement,
    WorkerAssignment,
    place_groups,
    round_robin_requests,
)
from batchscore.plan.types import GroupMember, PrefixGroup, Request
from batchscore.plan.validate import prompt_problem, requests_from_token_lists

__all__ = [
    "GroupMember",
    "Plan",
    "Placement",
    "PlanInputError",
    "PlanOptions",
    "PlanStats",
    "PrefixCache",
    "PrefixGroup",
    "Request",
    "SimResult",
    "WorkerAssignment",
    "build_plan",
    "place_groups",
    "prompt_problem",
    "requests_from_token_lists",
    "round_robin_requests",
    "simulate",
    "simulate_groups",
]
