"""Planning: the cost model, the layout planner and adaptive T (pure Python, no torch)."""
