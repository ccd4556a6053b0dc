"""What every pass shares: the one op taxonomy (``ops``), the trace utilities and rewrites
(``trace``), and the memory model (``memory``: storages, liveness, estimated peaks and what a
forward saves). Nothing here changes a trace's order or its saved set by itself; the passes do."""
