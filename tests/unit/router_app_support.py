"""The router app in-process with empty pools, for the HTTP-surface tests
(test_router_api.py, test_router_request_fields.py, test_router_tokenize.py,
test_router_tools_api.py): every valid request is answered 503, every bad one its 4xx with
the OpenAI error body."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from router.app import create_app
from router.discovery import StaticDiscovery
from router.metrics import RouterMetrics
from router.routing.pool import InstancePool
from router.settings import RouterSettings
from router.tokenizer import PromptProcessor

MODEL = "tiny"


def build_app(model_dir: Path, **settings: Any) -> Any:
    metrics = RouterMetrics()
    pools = [
        InstancePool(role, StaticDiscovery([]), metrics=metrics) for role in ("prefill", "decode")
    ]
    processor = PromptProcessor.from_model_dir(
        model_dir, max_model_len=settings.pop("max_model_len", None)
    )
    cfg = RouterSettings(served_model_names=[MODEL], **settings)
    return create_app(cfg, pools[0], pools[1], processor=processor, metrics=metrics)


def assert_error(resp: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
