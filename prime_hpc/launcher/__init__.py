"""Submit time, on the login node: placement (`plan`), the job scripts (`render`), what a
submitted job is doing and its cancel (`state`), sweeps (`sweep`) and benches (`bench`),
and the one entry point of them all (`launch`). The backends that run the jobs are
`prime_hpc.sched`; what runs inside the allocation is `prime_hpc.job`."""
