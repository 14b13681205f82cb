"""The per-step extras, run in order before each step (docs/design.md §3 "The step"): each
hook owns its state and may finish requests (through ``StepOutputs``).

1. ``GuidedAdmission``: requests whose grammar finished compiling join the scheduler.
2. ``KVTransfers`` (``engine/step/kv_transfers.py``): finished KV loads and saves.
3. ``LoRAExpiry``: requests that waited too long for an adapter slot fail.
4. ``SpecProposals``: draft tokens for the running requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from engine.core.outputs import RequestOutput
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.lora.manager import SLOT_TIMEOUT_ERROR
from engine.step.kv_transfers import KVTransfers
from engine.step.outputs import StepOutputs

if TYPE_CHECKING:
    from engine.kv.transfers import KVTransferCoordinator
    from engine.sampling.guided import GuidedDecoding
    from engine.spec_decode.decoder import SpecDecoder
    from engine.step.output_processor import OutputProcessor


class StepHook(Protocol):
    def before_step(self) -> list[RequestOutput]:
        """Act before the step; the outputs of requests this finished."""
        ...

    def has_work(self) -> bool:
        """Something is pending here that a later step will finish."""
        ...


class SlotDeadlines(Protocol):
    """What ``LoRAExpiry`` asks of the engine's LoRA serving (``engine/lora_serving.py``)."""

    def expired(self, scheduler: Scheduler) -> list[Request]: ...


def route(scheduler: Scheduler, transfers: KVTransferCoordinator | None, request: Request) -> None:
    """Hand a ready request to the scheduler, or to the KV loads when its prompt's KV comes
    from elsewhere (it waits registered until the blocks land)."""
    if request.remote_kv is None:
        scheduler.add_request(request)
    else:
        assert transfers is not None
        scheduler.register(request)
        transfers.add_remote(request)


class GuidedAdmission:
    def __init__(
        self,
        guided: GuidedDecoding,
        scheduler: Scheduler,
        transfers: KVTransferCoordinator | None,
        post: StepOutputs,
    ) -> None:
        self.guided, self.scheduler, self.transfers, self.post = guided, scheduler, transfers, post

    def before_step(self) -> list[RequestOutput]:
        """Route requests whose grammar is ready; fail those it cannot serve."""
        if not self.guided.has_pending():
            return []
        ready, failed = self.guided.poll()
        for request in ready:
            route(self.scheduler, self.transfers, request)
        return [self.post.fail(failure.request, failure.error) for failure in failed]

    def has_work(self) -> bool:
        return self.guided.has_pending()


class LoRAExpiry:
    def __init__(self, lora: SlotDeadlines, scheduler: Scheduler, post: StepOutputs) -> None:
        self.lora, self.scheduler, self.post = lora, scheduler, post

    def before_step(self) -> list[RequestOutput]:
        return [self.post.fail(r, SLOT_TIMEOUT_ERROR) for r in self.lora.expired(self.scheduler)]

    def has_work(self) -> bool:
        return False


class SpecProposals:
    def __init__(self, spec: SpecDecoder, scheduler: Scheduler) -> None:
        self.spec, self.scheduler = spec, scheduler

    def before_step(self) -> list[RequestOutput]:
        self.spec.propose(self.scheduler.running)
        return []

    def has_work(self) -> bool:
        return False


def step_hooks(
    post: StepOutputs,
    outputs: OutputProcessor,
    lora: SlotDeadlines | None,
) -> list[StepHook]:
    """The hooks an engine with these parts runs, in order (``post`` holds the scheduler,
    the guides, the drafts and the KV transfers)."""
    scheduler, transfers = post.scheduler, post.transfers
    hooks: list[StepHook] = [GuidedAdmission(post.guided, scheduler, transfers, post)]
    if transfers is not None:
        hooks.append(KVTransfers(transfers, scheduler, outputs, post))
    if lora is not None:
        hooks.append(LoRAExpiry(lora, scheduler, post))
    if post.spec is not None:
        hooks.append(SpecProposals(post.spec, scheduler))
    return hooks
