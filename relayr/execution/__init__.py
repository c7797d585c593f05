"""Acting: a task's executor, its claims and attempts, and the writes a run makes as its rule."""
