"""Mitigations for long-sequence memory, one folder per rung of the ladder.

``<rung>/`` holds the rung (``<rung>.py``: a policy with ``is_applicable(model) -> (bool, reason)``
and ``apply(model) -> MitigationResult`` on any ``nn.Module``, and its :class:`.base.Rung`, named
``RUNG``), its torch-free ``SPEC`` with its measured step-time prior (``<rung>_spec.py``), helpers
only it uses, and its method card (the folder's docstring). :mod:`.ladder` is the registry by name;
:data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` lists the built-in folders. Nothing here imports
Lightning (strategies are recognised by class name) nor transformers (duck typing); this package
and each folder's ``__init__`` import nothing, so a rung's spec loads without torch.
"""
