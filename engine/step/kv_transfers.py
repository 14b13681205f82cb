"""The step hook of KV transfers (P/D): what the engine does each step with the
connector's finished loads and saves (the transfers themselves are
``engine/kv/transfers.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.outputs import KvSaveResult, RequestOutput
from engine.core.request import Request, RequestStatus
from engine.kv.transfers import KVTransferCoordinator, LoadOutcome

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler
    from engine.step.output_processor import OutputProcessor
    from engine.step.outputs import StepOutputs


class KVTransfers:
    """Finished loads make their requests ready (or fail them), finished saves end their
    requests, released holds free their blocks, and queued loads start."""

    def __init__(
        self,
        transfers: KVTransferCoordinator,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        post: StepOutputs,
    ) -> None:
        self.transfers, self.scheduler, self.outputs, self.post = (
            transfers,
            scheduler,
            outputs,
            post,
        )

    def before_step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        found = self.transfers.poll()
        for outcome in found.loads:
            outputs += self._on_loaded(outcome)
        for request, saved in found.saves:
            outputs.append(self._on_saved(request, saved))
        for request in found.released:
            self.scheduler.release(request)
        for request in self.transfers.start_pending_loads():
            self.scheduler.make_ready(request)
        return outputs

    def has_work(self) -> bool:
        return self.transfers.has_work()

    def _on_loaded(self, outcome: LoadOutcome) -> list[RequestOutput]:
        request = outcome.request
        if outcome.aborted:  # its abort output went out already; the blocks may go now
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            return []
        request.kv_load_seconds = outcome.seconds
        request.kv_blocks_loaded = outcome.blocks_loaded
        request.kv_blocks_recomputed = outcome.blocks_recomputed
        request.kv_bytes_loaded = outcome.bytes_loaded
        if not outcome.ok:
            return [self.post.fail(request, outcome.error or "KV load failed")]
        self.scheduler.make_ready(request)
        return []

    def _on_saved(self, request: Request, saved: KvSaveResult) -> RequestOutput:
        if saved.held:  # held (p2p): the blocks go when the connector releases them
            self.scheduler.requests.pop(request.request_id, None)
        else:
            self.scheduler.release(request)
        out = self.outputs.output(request, [], "", finished=True)
        out.kv_saved = saved
        return out
