"""Where a rank sits: its torch world, the device mesh over it, and its group in the run.

Two worlds run the same group runtime:

- **one torch job** (``flower-shard train``): the world holds all G groups; the mesh has a
  ``group`` dimension and the outer sync all-reduces over it;
- **one Flower group** (the flower and collective transports): the world is ONE group of the
  federation; its mesh has G = 1 and the group's index comes from the server.

Everything else (data part, model, optimizer, checkpoints) reads the :class:`Placement` and
never asks which of the two it is in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flower_shard.config import ConfigError, TrainConfig
from flower_shard.runtime.topology import Topology


@dataclass
class Placement:
    """This rank's place: topology, mesh, device, and its group among the run's groups.

    Build it with :meth:`whole_run` or :meth:`one_group` once the process group is up.
    """

    topology: Topology
    """The degrees of THIS torch world (G = 1 when the world is one Flower group)."""
    mesh: object
    """The named ``DeviceMesh`` over this world (see :mod:`flower_shard.runtime.topology`)."""
    device: torch.device
    group: int
    """This rank's group in the run: which data part it trains on, where it checkpoints."""
    groups: int
    """G of the run (the data is split into this many parts)."""
    _group_pg: object = field(default=None, repr=False)

    @classmethod
    def whole_run(cls, cfg: TrainConfig, device: torch.device) -> Placement:
        """One torch job holding all of the run's G x K ranks."""
        world = dist.get_world_size()
        if world != cfg.world_size:
            raise ConfigError(
                f"torchrun started {world} ranks but the configuration needs N = G x K "
                f"= {cfg.world_size}; launch with --nproc-per-node / --nnodes matching it"
            )
        topology = Topology(world, cfg.groups, cfg.sharding, cfg.replicate)
        mesh = topology.build_mesh(device.type)
        return cls(topology, mesh, device, topology.group_of(dist.get_rank()), cfg.groups)

    @classmethod
    def one_group(cls, cfg: TrainConfig, device: torch.device, group: int) -> Placement:
        """A torch world that is group ``group`` of a federation of ``cfg.groups`` groups."""
        topology = Topology(dist.get_world_size(), 1, cfg.sharding, cfg.replicate)
        return cls(topology, topology.build_mesh(device.type), device, group, cfg.groups)

    @property
    def rank(self) -> int:
        """This rank in its torch world."""
        return dist.get_rank()

    @property
    def world(self) -> int:
        return self.topology.world_size

    @property
    def group_size(self) -> int:
        """K: ranks per group."""
        return self.topology.group_size

    @property
    def rank_in_group(self) -> int:
        return self.topology.rank_in_group(self.rank)

    def sharding_mesh(self):
        """The sub-mesh the group shards its model over."""
        return self.topology.sharding_mesh(self.mesh)

    def replicate_pg(self):
        """HSDP: this rank's replicas inside its group; None for FSDP or R = 1."""
        return self.topology.replicate_group(self.mesh)

    def outer_pg(self):
        """The process group across the groups of this world (None when it holds one group)."""
        return self.mesh.get_group("group") if self.topology.groups > 1 else None

    @property
    def group_pg(self):
        """The process group of this rank's group (the world, when the world is one group)."""
        if self._group_pg is None:
            if self.topology.groups == 1:
                self._group_pg = dist.group.WORLD
            else:  # every rank must create every group's subgroup, in the same order
                k = self.group_size
                self._group_pg, _ = dist.new_subgroups_by_enumeration(
                    [list(range(g * k, (g + 1) * k)) for g in range(self.topology.groups)]
                )
        return self._group_pg
