"""The torch group runtime: topology, sharding, models, train loop, outer sync, checkpoints."""
