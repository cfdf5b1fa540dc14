"""Inference: vLLM servers with in-place weight updates (`server`), the router in front of
them (`router`) and the client the orchestrator and tests use (`client`).

Importing this package imports no vLLM; `python -m prime_hpc.inference` starts a server.
"""
