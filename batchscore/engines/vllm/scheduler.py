"""Group-aware scheduling inside vLLM (BatchLLM §3.3), as a `scheduler_cls` subclass.

The engine adds requests in plan order and tags each with its prefix group (`GROUP_KEY` in the
request's `SamplingParams.extra_args`: the group's number, how many requests it has, how many
whole KV blocks its shared prefix fills). vLLM's FCFS admission over that order already admits
the groups in order and fills each step's token budget from as many groups as fit. What it
does not know is that a group's prefix will be read again: once no member of the group is
running (between admissions, or after a preemption) its prefix blocks are free and evictable.
This scheduler holds one reference on a group's prefix blocks from the step in which its first
admitted member has the whole prefix allocated (a chunked prefill may take several steps) until
the group's last request has finished, then releases them (the blocks stay cached, evictable
as any other).

Cost: everything here is a dict look-up per request, plus one touch and one free of the prefix
blocks per group; it never changes what vLLM schedules, so a run takes the same steps with the
same tokens as stock scheduling (`batchscore bench vllm` prints both).

Runs inside vLLM's engine-core process; vLLM names this interface non-public, so the engine
uses it only where asked (`VllmEngine(group_scheduling=True)`).
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler

from batchscore.engines.vllm.scheduler_name import GROUP_KEY


class GroupAwareScheduler(Scheduler):
    """vLLM's scheduler, holding each prefix group's prefix blocks until its last request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._group_of: dict[str, int] = {}  # request id -> group
        self._left: dict[int, int] = {}  # group -> requests not finished yet
        self._prefix_blocks: dict[int, int] = {}  # group -> whole blocks of its shared prefix
        self._pending: dict[int, str] = {}  # group -> the admitted member whose prefix is not all allocated yet
        self._held: dict[int, list] = {}  # group -> the prefix blocks this scheduler holds

    def add_request(self, request) -> None:
        tag = ((request.sampling_params.extra_args or {}) if request.sampling_params else {}).get(GROUP_KEY)
        if tag is not None:
            group, count, blocks = (int(v) for v in tag)
            self._group_of[request.request_id] = group
            self._left.setdefault(group, count)
            self._prefix_blocks.setdefault(group, blocks)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        for new in output.scheduled_new_reqs:
            group = self._group_of.get(new.req_id)
            if group is not None and group not in self._held and group not in self._pending \
                    and self._prefix_blocks.get(group):
                self._pending[group] = new.req_id
        if self._pending:  # a group or two at a time: the ones being admitted now
            for group, req_id in list(self._pending.items()):
                self._try_hold(group, req_id)
        return output

    def _try_hold(self, group: int, req_id: str) -> None:
        """Hold the group's prefix blocks once `req_id` has all of them allocated and full
        (vLLM advanced its computed tokens in `schedule`); a partly filled block is never held,
        so vLLM stays the sole writer of every block it still fills."""
        request = self.requests.get(req_id)
        if request is None:  # finished or aborted before its prefix was whole: the next member takes over
            del self._pending[group]
            return
        count = self._prefix_blocks[group]
        if request.num_computed_tokens < count * self.cache_config.block_size:  # the engine's tag counts these blocks
            return  # chunked prefill (or preempted): try again next step
        blocks = self.kv_cache_manager.get_blocks(req_id).blocks[0][:count]
        if len(blocks) < count:
            return
        self.kv_cache_manager.block_pool.touch(blocks)
        self._held[group] = list(blocks)
        del self._pending[group]

    def _free_request(self, request, *args, **kwargs):
        group = self._group_of.pop(request.request_id, None)
        result = super()._free_request(request, *args, **kwargs)
        if group is not None:
            if self._pending.get(group) == request.request_id:
                del self._pending[group]
            self._left[group] -= 1
            if self._left[group] <= 0:
                self._release(group)
        return result

    def _release(self, group: int) -> None:
        self._left.pop(group, None)
        self._prefix_blocks.pop(group, None)
        self._pending.pop(group, None)
        held = self._held.pop(group, None)
        if held:
            self.kv_cache_manager.block_pool.free_blocks(reversed(held))  # the prefix's tail evicted first

    def reset_prefix_cache(self, *args, **kwargs):
        for group in list(self._held):  # nothing may hold a block through a reset
            held = self._held.pop(group)
            self.kv_cache_manager.block_pool.free_blocks(reversed(held))
        return super().reset_prefix_cache(*args, **kwargs)

    def held_groups(self) -> int:
        return len(self._held)
