"""Dry runs: the user's own step on a fake copy of the module under ``FakeTensorMode``, on one rank
or in a fake process group of N ranks, and the callable the planner is handed."""
