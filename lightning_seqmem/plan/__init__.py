"""Every decision, torch-free: the planner and its checkpointed state. Imports only ``core``."""
