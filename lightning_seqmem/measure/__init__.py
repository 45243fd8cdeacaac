"""Torch, no Lightning: cutting batches, probes that measure a step, real short steps traced
without a Trainer."""
