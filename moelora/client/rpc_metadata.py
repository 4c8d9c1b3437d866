"""gRPC metadata keys that the services and their clients agree on (the wire contract)."""

from __future__ import annotations

#: Initial metadata of a WatchAdapters stream: the sequence it starts after. Once a client
#: has received it, every later event reaches the stream.
WATCH_START_METADATA = "moelora-watch-after-sequence"
