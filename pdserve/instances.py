"""The service addresses of one `pdserve up` and moving a service to new ports.

`pdserve up` writes ``instances.json`` in the run's directory (``{"prefill": [...],
"decode": [...]}``) and starts the router with ``--discovery file`` on it
(``router/discovery/file.py``). When a service is to be restarted and its gRPC or metrics
port is held by another process, the supervisor calls :meth:`InstanceTable.move`: new
ports, the child's argv and health probe rewritten, and the file rewritten atomically, so
the router drops the old address and checks the new one within a second
(docs/design.md §5, "Supervision"). Torch-free.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.procs import Child, free_ports, grpc_probe

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServicePorts:
    role: str  # "prefill" | "decode"
    port: int
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def port_taken(port: int, host: str = "127.0.0.1") -> bool:
    """True when another process holds ``port``. SO_REUSEADDR as the servers bind, so a
    port whose old connections sit in TIME-WAIT counts as free (it is, for them)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


class InstanceTable:
    """Owns the services' ports and the instances file the router follows."""

    def __init__(self, path: Path, tls: Any = None, tls_server_name: str = "") -> None:
        self.path = path
        self._tls, self._server_name = tls, tls_server_name
        self._ports: dict[str, ServicePorts] = {}  # child name -> its ports, in start order

    def add(self, name: str, ports: ServicePorts) -> None:
        self._ports[name] = ports

    def knows(self, child: Child) -> bool:
        return child.name in self._ports

    def address_of(self, child: Child) -> str:
        return self._ports[child.name].address

    def addresses(self, role: str) -> list[str]:
        return [p.address for p in self._ports.values() if p.role == role]

    def write(self) -> None:
        """Rewrite the file atomically (temp file + rename): the router never reads half."""
        payload = {role: self.addresses(role) for role in ("prefill", "decode")}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(self.path)

    def blocked(self, child: Child) -> bool:
        """True when another process holds one of ``child``'s ports (it cannot start there)."""
        ports = self._ports.get(child.name)
        return ports is not None and (port_taken(ports.port) or port_taken(ports.metrics_port))

    def move(self, child: Child) -> str:
        """Give ``child`` new ports (argv, probe, file); returns its new address."""
        old = self._ports[child.name]
        port, metrics_port = free_ports(2)
        child.argv = _replace_flag(child.argv, "--port", str(port))
        child.argv = _replace_flag(child.argv, "--metrics-port", str(metrics_port))
        new = ServicePorts(old.role, port, metrics_port)
        self._ports[child.name] = new
        child.probe = grpc_probe(new.address, self._tls, self._server_name)
        self.write()
        logger.info("%s moved from %s to %s", child.name, old.address, new.address)
        return new.address


def _replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with the value after ``flag`` replaced (the flag must be there)."""
    out = list(argv)
    index = out.index(flag)
    out[index + 1] = value
    return out
