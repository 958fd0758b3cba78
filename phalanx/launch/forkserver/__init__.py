"""Workers forked from a server that imported torch once: `phalanx run --start-method forkserver` (the default).

A fresh worker spends seconds of CPU importing torch before its first line, at every start and every restart, on
every rank of the node at once. So the `phalanx` command readies its launcher before torch loads and forks it into
the node's server (prepare.py); the server and each worker it forks, as the launcher sees them (server.py); torch
elastic's worker starts sent to it (elastic_handler.py). (Not multiprocessing's fork server: `phalanx.spawn`'s.)
"""
