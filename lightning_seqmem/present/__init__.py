"""Plain values to text and figures: the report, the TensorBoard layout and figure (no I/O)."""
