"""Launcher: placement (plan), rendering (render), backends (slurm, local), runtime
helpers run inside the job (attempt, head)."""
