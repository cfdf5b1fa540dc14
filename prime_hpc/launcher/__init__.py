"""Submit time, on the login node: placement (`plan`), the job scripts (`render`), the
backends that submit and ask about jobs (`slurm`, `slurm_state`, `local`, `state`) and the
one entry point of them all (`launch`). What runs inside the allocation is `prime_hpc.job`."""
