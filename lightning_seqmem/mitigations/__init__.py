"""Mitigations for long-sequence memory, one folder per rung of the ladder.

Each rung lives in ``lightning_seqmem/mitigations/<rung>/``: the rung itself (``<rung>.py``: the
policy, a small class with ``is_applicable(model) -> (bool, reason)`` and
``apply(model) -> MitigationResult`` on any ``nn.Module``, and its
:class:`~lightning_seqmem.mitigations.base.Rung`, named ``RUNG``), its torch-free spec with its
measured step-time prior (``<rung>_spec.py``: the ``SPEC`` the planner reads), the helpers only it
uses, and its method card (the folder's docstring). :mod:`.ladder` is the registry the callback,
the dry run and ``seqmem plan`` use by name; :data:`~lightning_seqmem.core.rungs.RUNG_FOLDERS` lists
the built-in folders, one line each. Nothing here imports Lightning (strategies are recognised by
class name) nor Hugging Face transformers (duck typing); this package and each folder's
``__init__`` import nothing, so a rung's spec loads without torch.
"""
