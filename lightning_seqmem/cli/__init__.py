"""The ``seqmem`` command (:mod:`.main`)."""
