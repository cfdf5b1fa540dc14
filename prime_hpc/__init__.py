"""prime-hpc: SLURM-native asynchronous RL and SFT for language models."""

__version__ = "0.1.0"
