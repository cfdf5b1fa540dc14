"""What runs inside the allocation, started by the job script: an attempt's start and end
(`attempt`), the head task (`head`), the stall watchdog (`watchdog`), the preflight of
`prime-hpc doctor` on every node (`preflight`) and how the local job script starts a
component (`child`). Nothing here runs at submit time."""
