"""Watching a run from a terminal: follow its logs (`tail`), its vitals (`vitals`: step,
rate, reward, ETA) and its curves (`plot`). Read-only, light to import (no torch, no Hydra)."""
