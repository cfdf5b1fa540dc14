"""What every component process (orchestrator, inference, trainer) uses while it runs, on
top of the run directory: the stop and checkpoint requests of `control/` and dying with its
parent (`stopping`), the metrics files and their W&B forwarding (`metrics`), the open files
limit raised at the start (`limits`)."""
