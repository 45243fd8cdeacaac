"""Plain values to text and figures: the report and the TensorBoard layout and figure. No loggers, no
files."""
