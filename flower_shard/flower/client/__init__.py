"""The ClientApp and its client of the node's group."""
