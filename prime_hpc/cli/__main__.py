import sys

from prime_hpc.cli import main

sys.exit(main())
