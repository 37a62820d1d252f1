"""Flower ServerApp strategies (FL+FSDP rounds on a Flower server)."""
