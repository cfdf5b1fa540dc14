"""What runs inside the allocation, started by the job script: an attempt's start and end
(`attempt`), the head task (`head`), the stall watchdog (`watchdog`) and the preflight of
`prime-hpc doctor` on every node (`preflight`). Nothing here runs at submit time."""
