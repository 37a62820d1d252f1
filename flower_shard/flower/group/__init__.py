"""The long-lived torchrun group behind one Flower client: control service and worker."""
