"""The run directory: the only contract between the launcher, the orchestrator, inference
and the trainer, on the shared filesystem.

- `layout`: every path (`RunDir`);
- `files`: atomic writes, `STABLE` markers, NFS-safe waits, and the readers of files' ends
  and of JSON-lines metrics;
- `batch`: the rollout batch a step hands from the orchestrator to the trainer;
- `checkpoints`: which checkpoint steps exist, are complete and resumable;
- `window`: which policies a step may train on (the async window);
- `drops`: why the orchestrator drops a group, and the metrics key counting each reason;
- `fleet`: the inference servers' states (the supervisors' and the weight relay's files);
- `jobs`: `job.json`, the launcher's record of a run, and the list of recent runs;
- `bench`: a bench run's results (`bench.json`).
"""

from prime_hpc.rundir.files import (
    STABLE,
    TMP_PREFIX,
    MarkerError,
    WaitTimeout,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    exists_fresh,
    is_stable,
    jsonl_row,
    last_line,
    mark_stable,
    publish_dir,
    read_json,
    read_rows,
    read_tail,
    remove_marked,
    stable_time,
    staging_dir,
    tail,
    tail_lines,
    truncate_jsonl,
    wait_file,
    wait_for,
    wait_stable,
    with_umask,
)
from prime_hpc.rundir.layout import (
    BEAT_S,
    CHECKPOINT_PARTS,
    COMPONENTS,
    GROUPS,
    RunDir,
    Slot,
    parse_slot,
    server_slot,
)

__all__ = [
    "BEAT_S",
    "CHECKPOINT_PARTS",
    "COMPONENTS",
    "GROUPS",
    "STABLE",
    "TMP_PREFIX",
    "MarkerError",
    "RunDir",
    "Slot",
    "WaitTimeout",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "exists_fresh",
    "is_stable",
    "jsonl_row",
    "mark_stable",
    "parse_slot",
    "publish_dir",
    "read_json",
    "read_rows",
    "read_tail",
    "remove_marked",
    "server_slot",
    "stable_time",
    "staging_dir",
    "tail",
    "last_line",
    "tail_lines",
    "truncate_jsonl",
    "wait_file",
    "wait_for",
    "wait_stable",
    "with_umask",
]
