"""Fault tolerance: the MPI library's fault-tolerant calls (:mod:`.ft_backend`), detecting
a dead rank (:mod:`.failure_detection`), agreeing on it (:mod:`.agreement`) and shrinking
the world to the survivors (:mod:`.fault_tolerance`). Imports the MPI and base layers."""
