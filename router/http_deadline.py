"""A deadline for a request's headers (docs/router.md "Input limits").

uvicorn times out a keep-alive connection that stays idle between requests, but not one
that has started a request and never finishes its headers (a byte at a time, or nothing
after connecting): such connections would be held forever. The protocol class below, a
subclass of the one uvicorn would pick, closes a connection that has been waiting for a
request's headers for ``timeout`` seconds: from the connection's start, or from the first
byte after the previous response. The body has its own deadline in the app
(``GuardMiddleware``), because the body is read by the app, not by the protocol.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)


def _base_protocol() -> type[Any]:
    """uvicorn's ``http="auto"`` choice: httptools when installed, else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is a dependency of uvicorn[standard]
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def header_deadline_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with a ``timeout``-second deadline for request headers."""
    if timeout <= 0:
        raise ValueError("the header read timeout must be > 0")
    base = _base_protocol()

    class HeaderDeadlineProtocol(base):  # type: ignore[misc, valid-type]
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self._waiting_for_headers():
                self._disarm()
            elif self._deadline is None:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _waiting_for_headers(self) -> bool:
            cycle = self.cycle
            return cycle is None or bool(cycle.response_complete)

        def _arm(self) -> None:
            self._deadline = asyncio.get_running_loop().call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self._waiting_for_headers() and not self.transport.is_closing():
                logger.info("closing a connection whose request headers took over %.0f s", timeout)
                self.transport.close()

    return HeaderDeadlineProtocol
