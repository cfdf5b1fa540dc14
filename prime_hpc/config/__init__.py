"""Composition (Hydra), typed schema and cross-field validation of a run's config."""

from prime_hpc.config.compose import compose, conf_dir, expand_sweep, to_yaml

__all__ = ["compose", "conf_dir", "expand_sweep", "to_yaml"]
