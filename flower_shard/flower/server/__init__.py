"""The Flower server side: the ServerApp, the ShardedFedAvg strategy and its transports.

``server_app`` (the ServerApp: run config, held-out evaluation, outputs) runs ``strategy``
(the round loop), which asks ``exchange`` to send and receive, ``replies`` to check every
reply, ``transports`` (one module per transport) to build messages and aggregate, with the
math in ``aggregation``; ``schedule`` plans the rounds and ``stats`` records them.
"""
