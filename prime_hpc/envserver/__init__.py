"""Env servers: an env entry whose groups run in processes of their own beside the
orchestrator (`orchestrator.env[i].workers` >= 1), so that a CPU-heavy reward does not stall
the orchestrator's loop. `server.py` is the server process of one entry, `worker.py` its
workers, `remote.py` the orchestrator's side (starting a server, `RemoteGenerator`).
Classic verifiers environments only."""
