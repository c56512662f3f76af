"""Services on the primitives: the timeline of collectives (:mod:`.timeline`) and the
job's topology for model parallelism (:mod:`.topology`)."""
