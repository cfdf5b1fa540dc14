from prime_hpc.orchestrator import main

main()
