"""``python -m service prefill|decode [flags]``: one gRPC service process, as
``pdserve prefill|decode`` runs it (``service/roles.py``)."""

from __future__ import annotations

import sys

from service.roles import main

if __name__ == "__main__":
    sys.exit(main())
