"""The MPI layer: the MPI library in use and its quirks (:mod:`.mpi_impl`), forming the
world when another launcher started the processes (:mod:`.launch`), the environment for
torch.distributed and UCX (:mod:`.mpi_env`, :mod:`.ucx_env`), shared memory and its
release (:mod:`.shm`, :mod:`.shutdown`) and the watchdog that aborts a stuck job
(:mod:`.watchdog`). Imports only the base layer below it."""
