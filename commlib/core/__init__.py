"""The core: commlib's communicator (:mod:`.communicator`), the process-wide world and its
start (:mod:`.runtime`), and the exit paths (:mod:`.exits`). Imports the fault-tolerance,
MPI and base layers; the primitives are built on it."""
