"""Planning: the cost model, the memory model, the layout planner and adaptive T (pure Python;
torch only to read a model directory's shape)."""
