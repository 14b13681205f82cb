"""The scheduler: waiting and running queues, token budget, chunked prefill, preemption.

Each step it gives every running request its next tokens first (decode-first), then admits
waiting requests while budget, sequence slots and KV blocks last. There is no prefill or
decode phase: a request simply has ``num_computed_tokens`` of ``num_tokens``.
"""

from __future__ import annotations

import contextlib
import heapq
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.block_pool import KVCacheBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # includes the drafts below
    block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step
    # The KV manager's table epoch for ``block_ids`` (-1: unknown, the runner copies all of
    # it). While it is unchanged the table only grew since the request's last step.
    table_epoch: int = -1


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0


class WaitingQueue:
    """FCFS (deque) or priority (heap on (priority, arrival)) order of waiting requests."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[Request] = []

    def push(self, request: Request) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fifo.append(request)

    def push_front(self, request: Request) -> None:
        """Preempted requests go back first (FCFS); the heap orders them by itself."""
        if self.policy == "priority":
            heapq.heappush(self._heap, request)
        else:
            self._fifo.appendleft(request)

    def peek(self) -> Request:
        return self._heap[0] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap) if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap.remove(request)
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in no promised order."""
        return iter(self._heap if self.policy == "priority" else self._fifo)


class Scheduler:
    def __init__(
        self, config: EngineConfig, kv_manager: KVCacheManager, lora: LoRAManager | None = None
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.lora = lora  # GPU slots of LoRA adapters (engine/lora/manager.py)
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}

    def add_request(self, request: Request) -> None:
        self.register(request)
        if request.status is RequestStatus.WAITING:
            self.waiting.push(request)

    def register(self, request: Request) -> None:
        """Know a request that is not queued yet (its grammar compiles, its KV is remote)."""
        self.requests[request.request_id] = request

    def make_ready(self, request: Request) -> None:
        """A request whose remote KV has arrived joins the waiting queue's front."""
        request.status = RequestStatus.WAITING
        self.waiting.push_front(request)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(
        self, busy: frozenset[str] | set[str] = frozenset(), max_seqs: int | None = None
    ) -> SchedulerOutput:
        """The next step's requests. Pipeline parallelism's in-flight batches
        (engine/step/pp_batches.py): ``busy`` requests are in a batch still in flight and are
        neither scheduled nor preempted, and the step takes at most ``max_seqs`` requests
        (so the running ones spread over the batches in flight)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted_now = False
        seats = self.config.max_num_seqs if max_seqs is None else max_seqs
        for request in list(self.running):
            if request.status is RequestStatus.PREEMPTED or request.request_id in busy:
                # Preempted earlier in this loop. (A status check, not `in self.running`:
                # that is O(n) per request, and with 256 running it cost ~20 ms a step.)
                continue
            if len(out.scheduled) >= seats:
                break
            pending = request.num_tokens - request.num_computed_tokens
            # Drafts ride along only on a decode step (one pending token), within budget.
            num_spec = max(0, min(len(request.spec_token_ids), budget - 1)) if pending == 1 else 0
            num_new = min(pending, budget) + num_spec
            if num_new <= 0:
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                if num_spec:  # drop the drafts before preempting anyone
                    num_new, num_spec = num_new - num_spec, 0
                    continue
                victim = self._pick_victim(busy)
                budget += self._preempt(victim, out)
                preempted_now = True
                if victim is request:
                    break
            else:
                out.scheduled.append(
                    self._scheduled(request, num_new, request.spec_token_ids[:num_spec])
                )
                budget -= num_new
            if budget <= 0:
                break
        if not preempted_now:
            budget = self._admit_waiting(out, budget, seats)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def schedule_ahead(self, requests: list[Request]) -> list[ScheduledRequest] | None:
        """The next decode step of running ``requests`` whose newest token is still in
        flight (engine/step/async_scheduling.py): one slot each, at ``num_computed_tokens``.
        None when the pool is short; the caller then takes a synchronous step, which may
        preempt (blocks taken here for some requests stay theirs)."""
        out = []
        for request in requests:
            if self.kv.allocate_slots(request, 1) is None:
                return None
            out.append(self._scheduled(request, 1))
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, seats: int) -> int:
        # Requests whose adapter can get no slot now step aside (in order) for the others.
        no_slot: list[Request] = []
        budget = self._admit(out, budget, no_slot, seats)
        for request in reversed(no_slot):
            self.waiting.push_front(request)
        return budget

    def _admit(self, out: SchedulerOutput, budget: int, no_slot: list[Request], seats: int) -> int:
        while (
            len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(out.scheduled) < seats
        ):
            request = self.waiting.peek()
            if request.lora_name is not None and not self._take_lora_slot(request):
                no_slot.append(self.waiting.pop())
                continue
            hits: list[KVCacheBlock] = []
            num_hit_tokens = 0
            if self.kv.num_blocks_of(request.request_id) == 0:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - request.num_computed_tokens - num_hit_tokens
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                self._drop_lora_slot(request)
                break
            self.waiting.pop()
            if hits:
                request.num_computed_tokens += num_hit_tokens
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _scheduled(
        self, request: Request, num_new: int, spec: list[int] | None = None
    ) -> ScheduledRequest:
        # Draft positions never reach the prefix cache: only verified tokens may be shared.
        self.kv.cache_blocks(request, request.num_computed_tokens + num_new - len(spec or ()))
        block_ids, epoch = self.kv.block_table(request.request_id)
        return ScheduledRequest(request, num_new, block_ids, list(spec) if spec else [], epoch)

    def _take_lora_slot(self, request: Request) -> bool:
        assert self.lora is not None and request.lora_name is not None
        if request.lora_slot < 0:
            slot = self.lora.acquire(request.lora_name, request.lora_identity)
            if slot is None:
                return False
            request.lora_slot = slot
        return True

    def _drop_lora_slot(self, request: Request) -> None:
        if request.lora_slot >= 0 and self.lora is not None:
            self.lora.release(request.lora_slot)
            request.lora_slot = -1

    def _pick_victim(self, busy: frozenset[str] | set[str]) -> Request:
        """The request to preempt; never one in a batch in flight (``busy``). The request
        being scheduled is never busy, so there is always one."""
        candidates = [r for r in self.running if r.request_id not in busy] if busy else self.running
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Recompute preemption: drop the KV (cached blocks stay reusable) and requeue.
        Returns the budget the victim had already been given this step."""
        self.running.remove(request)
        self.kv.free(request)
        self._drop_lora_slot(request)
        if self.lora is not None and request.lora_name is not None:
            request.lora_deadline = self.lora.deadline()  # a new wait for a slot
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        refund = sum(s.num_new_tokens for s in out.scheduled if s.request is request)
        out.scheduled = [s for s in out.scheduled if s.request is not request]
        out.preempted.append(request.request_id)
        self.waiting.push_front(request)
        return refund

    def finish(self, request: Request, status: RequestStatus, *, keep_blocks: bool = False) -> None:
        """Take a request out of the queues; free its blocks unless a save still reads them."""
        request.status = status
        self._drop_lora_slot(request)
        if request in self.running:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        if not keep_blocks:
            self.release(request)

    def release(self, request: Request) -> None:
        """The one place a finished request's blocks are freed: at ``finish``, or once the
        KV transfer that still read them (``keep_blocks``) is done."""
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
