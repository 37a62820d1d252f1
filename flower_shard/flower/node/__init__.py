"""``flower-shard node``: the node launcher and the patches of Flower's SuperNode."""
