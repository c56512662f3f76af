"""The base layer: what every other layer uses and that needs no MPI. Errors
(:mod:`.errors`), the options read from the environment (:mod:`.options`), dtypes and
reduction operators (:mod:`.dtypes`, :mod:`.reduce_ops`), buffers of numpy, torch and cupy
(:mod:`.buffers`, :mod:`.host_views`, :mod:`.accelerator`) and the byte counters
(:mod:`.accounting`). Imports only :mod:`commlib.kernels` below it."""
