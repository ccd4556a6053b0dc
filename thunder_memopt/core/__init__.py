"""What every pass shares: the one op taxonomy (``ops``), the trace utilities and rewrites
(``trace``), the memory model (``memory``: storages, liveness, estimated peaks and what a
forward saves) and the time model (``cost``: FLOPs, bytes moved and a device's rates). Nothing
here changes a trace's order or its saved set by itself; the passes do."""
