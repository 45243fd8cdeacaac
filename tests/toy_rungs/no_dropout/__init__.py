"""No dropout: every ``nn.Dropout`` at ``p = 0``, so its masks are no longer saved for backward.

What it does: sets each dropout's probability to 0 (a real, measurable saving: about 10% on the
dropout GPT of tests/test_rung_protocol.py). When it helps: dropout masks hold part of the peak.
Cost: none measured (prior 0); it changes the training (no regularisation): a toy for the tests.
Files: :mod:`.no_dropout` (the rung, ``RUNG``), :mod:`.no_dropout_spec` (its spec).
"""
