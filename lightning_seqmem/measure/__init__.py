"""Torch, no Lightning: batch cuts, memory probes, real short steps traced without a Trainer."""
