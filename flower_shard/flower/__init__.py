"""The Flower side: ServerApp and strategy, ClientApp, the long-lived group, the node."""
