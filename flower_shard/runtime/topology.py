"""The topology: N ranks split into G groups of K ranks, and the named DeviceMesh built from it.

Global rank r belongs to group ``r // K``; the mesh is row-major, so the ranks of one group are
contiguous (on a cluster: one group per node or per set of nodes, the fast tier).

FSDP:  mesh dims ``(group, shard)``            with shape ``(G, K)``
HSDP:  mesh dims ``(group, replicate, shard)`` with shape ``(G, R, S)``, K = R x S

Inside a group the model is sharded over ``shard`` (and replicated over ``replicate``); between
groups, rank ``(g, ...)`` holds the same shard as rank ``(g', ...)`` at the same coordinates,
so the outer sync is an all-reduce over the ``group`` dimension alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from flower_shard.config.train import check_degrees


@dataclass(frozen=True)
class Topology:
    """Parallel degrees of a run; checks N = G x K and K = R x S on construction."""

    world_size: int
    """N: all ranks of the torch world."""
    groups: int
    """G: number of groups."""
    sharding: str = "fsdp"
    """`fsdp` or `hsdp`."""
    replicate: int = 1
    """R: HSDP replicate degree (1 for FSDP)."""

    def __post_init__(self) -> None:
        check_degrees(self.world_size, self.groups, self.sharding, self.replicate)

    @property
    def group_size(self) -> int:
        """K: ranks per group."""
        return self.world_size // self.groups

    @property
    def shard_degree(self) -> int:
        """S: ranks a parameter is sharded over (K for FSDP, K / R for HSDP)."""
        return self.group_size // self.replicate

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        if self.sharding == "hsdp":
            return ("group", "replicate", "shard")
        return ("group", "shard")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        if self.sharding == "hsdp":
            return (self.groups, self.replicate, self.shard_degree)
        return (self.groups, self.group_size)

    def group_of(self, rank: int) -> int:
        """The group a global rank belongs to."""
        return rank // self.group_size

    def rank_in_group(self, rank: int) -> int:
        """Position of a global rank inside its group (0 .. K-1)."""
        return rank % self.group_size

    def build_mesh(self, device_type: str):
        """Create the named DeviceMesh over the current world (the process group must be up)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)

    def sharding_mesh(self, mesh):
        """The sub-mesh a group shards over: ``shard`` (FSDP) or ``(replicate, shard)`` (HSDP)."""
        if self.sharding == "hsdp":
            return mesh["replicate", "shard"]
        return mesh["shard"]

    def replicate_group(self, mesh):
        """HSDP: the process group of this rank's replicas inside its group (they hold the same
        shard); None for FSDP or R = 1."""
        if self.sharding == "hsdp" and self.replicate > 1:
            return mesh.get_group("replicate")
        return None

    def describe(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape))
        return f"N={self.world_size} {self.sharding.upper()} mesh ({dims})"
