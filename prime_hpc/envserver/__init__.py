"""Env servers: an env entry whose groups run in processes of their own beside the
orchestrator (`orchestrator.env[i].workers` >= 1), so that a CPU-heavy reward does not stall
the orchestrator's loop. `server.py` is the server process of one entry, `worker.py` its
workers (`worker.py` a classic env's, `v1worker.py` a verifiers v1 task set's), `relay.py`
its v1 workers' model calls to the router; the orchestrator's side (starting a server,
`RemoteGenerator`) is `prime_hpc.orchestrator.envservers`."""
