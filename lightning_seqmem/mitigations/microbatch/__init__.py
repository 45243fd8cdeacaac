"""Micro-batching: each batch as micro-batches of one sample inside the step.

What it does: runs ``training_step`` on micro-batches and accumulates their gradients, weighted
so the loss and gradients equal the full batch's; the same batches, optimizer steps and schedule.
When it helps: the batch-proportional part of the peak (``B·(aL + bL²)``).
Cost: throughput of smaller kernels (prior 0.1); its first step checks the loss is a mean.
Files: :mod:`.microbatch` (the policy, the rung), :mod:`.microbatch_step` (the wrapped step),
:mod:`.microbatch_functional` (the functional step), :mod:`.microbatch_check` (the first-step
check), :mod:`.microbatch_twin` (the dry run's twin), :mod:`.microbatch_spec`.
"""
