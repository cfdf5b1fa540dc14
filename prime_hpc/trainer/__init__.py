"""The trainer: `python -m prime_hpc.trainer.rl` / `prime_hpc.trainer.sft` under torchrun.

Importing this package (or its `config`/`loss` modules' signatures) has no side effects;
torch, transformers and datasets are imported by the modules that need them.
"""
