"""A process that took a p2p source's control port (``test_p2p_squat.py``): it accepts
pullers, records every byte they send it (``record``, appended), and relays the connection
to the real source at ``relay`` (a restarted prefill on another port), both ways, so the
puller talks to the real prefill through it. Prints its address, then serves until killed.

    python -m tests.integration.p2p_squatter RECORD_FILE RELAY_HOST:PORT
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading

from kv_store.p2p.wire import split_address


def _pump(src: socket.socket, dst: socket.socket, record: str | None) -> None:
    try:
        while chunk := src.recv(1 << 16):
            if record is not None:
                with open(record, "ab") as f:
                    f.write(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def main() -> None:
    record, relay = sys.argv[1], split_address(sys.argv[2])
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"127.0.0.1:{listener.getsockname()[1]}", flush=True)
    while True:
        victim, _ = listener.accept()
        real = socket.create_connection(relay, timeout=10)
        threading.Thread(target=_pump, args=(victim, real, record), daemon=True).start()
        threading.Thread(target=_pump, args=(real, victim, None), daemon=True).start()


if __name__ == "__main__":
    main()
