"""What the request handlers use, built once per app and kept on ``app.state.deps``
(``router/app.py`` builds it; ``router/openai/handlers.py``, ``router/openai/admission.py`` and the LoRA
admin endpoints read it)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from common.tracing import Tracing
from router.errors import APIError
from router.legs.orchestrator import Orchestrator
from router.legs.trace import Trace
from router.lora import served_adapters
from router.metrics import RouterMetrics
from router.openai.body_parse import BodyLimits, parse_body
from router.settings import RouterSettings
from router.tokenizer import PromptProcessor

M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True)
class Deps:
    """What the handlers use, kept on ``app.state.deps``."""

    settings: RouterSettings
    processor: PromptProcessor
    orchestrator: Orchestrator
    metrics: RouterMetrics
    # Bounds the requests templated/tokenized on worker threads at once (``_prompts_of``).
    preprocess: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    active: int = 0
    tracing: Tracing | None = None  # --otlp-traces-endpoint (common/tracing.py)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    async def body(self, request: Request, model: type[M]) -> M:
        """The request's body as ``model``, under the element limits
        (router/openai/body_parse.py); a refusal is counted like any invalid request."""
        limits = BodyLimits(self.settings.max_chat_messages, self.settings.max_batch_prompts)
        try:
            return await parse_body(request, model, limits, self.preprocess)
        except APIError:
            Trace().finish(self.metrics, "invalid")
            raise

    def adapters(self) -> set[str]:
        """LoRA adapters the healthy instances serve (router/lora.py)."""
        orch = self.orchestrator
        return served_adapters([*orch.prefill_pool.instances(), *orch.decode_pool.instances()])
