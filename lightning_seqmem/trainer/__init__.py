"""The Lightning edge, the only wing with Lightning hooks: the callback, rank agreement, Trainer
access, outputs (loggers and files) and OOM diagnosis."""
