"""Runnable examples: ``mpiexec -n 4 python -m commlib.examples.train_digits``."""
