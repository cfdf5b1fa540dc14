import sys

from prime_hpc.inference.server import main

sys.exit(main())
