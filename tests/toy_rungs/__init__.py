"""Rungs written outside the package, each a folder, for the tests of the rung protocol."""
