from prime_hpc.inference.server import main
from prime_hpc.runtime.stopping import leave

code = main()
# Everything of the server has ended by now (its engine, its endpoint, its temporary
# directory); the interpreter's own teardown would only add the extension modules' leak
# reports (triton's nanobind: a few dozen lines at every exit) to the server's log.
leave(code)
