"""The streaming data plane: every rank streams its shard to sharded aggregators over grpcio.

Flower stays the control plane (rounds, membership, configs, metrics, checkpoints); its messages
carry only a per-round ticket. The weights travel here, rank by rank and chunk by chunk, never
gathered to one process and never through SuperLink, SuperNode or ClientApp.

- :mod:`.wire`: the frames on the wire (a binary chunk header, then the values) and the gRPC
  method names;
- :mod:`.tickets`: the per-round tokens that bind a stream to (run, round, group, rank);
- :mod:`.layout`: which aggregator owns which parameter, and which element ranges a rank's
  shard covers;
- :mod:`.spool`: each group's update spooled to disk as it arrives, folded in group order;
- :mod:`.aggregator`: one aggregator process (global weights and outer state of its
  parameters, the uplink and downlink services, the ServerApp's control calls);
- :mod:`.client`: a rank's uplink and downlink, and the ServerApp's control client;
- :mod:`.pool`: the ServerApp starts, addresses and stops its aggregators.
"""
