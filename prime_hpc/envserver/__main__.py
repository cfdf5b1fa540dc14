from prime_hpc.envserver.server import main

main()
