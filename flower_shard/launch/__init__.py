"""Starting processes: torchrun jobs, local Flower deployments, simulation, emulated networks."""
