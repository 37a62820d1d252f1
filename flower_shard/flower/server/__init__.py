"""The ServerApp, the ShardedFedAvg strategy and the server-side aggregation."""
