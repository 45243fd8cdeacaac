"""Activation offload: what each block saves for backward waits in pinned host memory (CUDA).

What it does: runs each repeated block under ``torch.autograd.graph.save_on_cpu(pin_memory=True)``.
When it helps: saved activations at the end of the forward hold the peak, at long lengths.
Cost: the host-device copies (prior 0.15, a guess until measured on a GPU). Opt-in, CUDA only.
Files: :mod:`.activation_offload` (the rung), :mod:`.activation_offload_spec`.
"""
