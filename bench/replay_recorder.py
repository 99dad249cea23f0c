"""Locust add-on for ``bench/serving.py``'s trace replay: every request sample as one JSON line.

Loaded beside the real locustfile (``locust -f load_tests/locustfile.py,bench/replay_recorder.py``)
when the environment variable ``REPLAY_RECORD`` names the output file. It defines no users and no
shape; it only listens to Locust's ``request`` event, so TTFT and latency percentiles can be taken
over all streamed requests at once (Locust's CSV has one row per request name, and its
"Aggregated" row mixes TTFT entries with whole-request times).

One line per sample: ``{"t": unix time, "type": "POST" | "TTFT", "name": ..., "ms": ..., "ok": bool}``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from locust import events

_PATH = os.environ.get("REPLAY_RECORD", "")
_file: Any = None


@events.request.add_listener
def _record(request_type: str, name: str, response_time: float, exception: Any = None, **_: Any) -> None:
    global _file
    if not _PATH:
        return
    if _file is None:
        _file = open(_PATH, "a", buffering=1)
    _file.write(
        json.dumps(
            {
                "t": round(time.time(), 4),
                "type": request_type,
                "name": name,
                "ms": round(float(response_time or 0.0), 2),
                "ok": exception is None,
            }
        )
        + "\n"
    )


@events.quitting.add_listener
def _close(**_: Any) -> None:
    if _file is not None:
        _file.close()
