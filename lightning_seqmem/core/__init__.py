"""Plain values and torch-free maths: units, checks, records, rung names, advice words, the
curriculum, the quadratic model, the timeline model and the forecaster. Imports neither torch nor
Lightning (``tests/test_imports.py`` enforces it for the whole folder)."""
