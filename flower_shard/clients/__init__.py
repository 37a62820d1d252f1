"""Flower ClientApp and the bridge to a running group."""
