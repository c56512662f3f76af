"""Command-line tools: ``commlib-info`` (:mod:`.info`) and ``commlib-selftest``
(:mod:`.selftest`)."""
