"""Device meshes for a world that may be the second (or tenth) of its process.

Why not ``init_device_mesh``: with the default group bound to a device (``device_id``, which the runtime
passes on CUDA), torch builds each mesh dimension with ``split_group`` -> ``ProcessGroupNCCL::split``,
which indexes ``groupRanks()`` of the default group by the process-wide ``local_id_`` of that group. After
an in-place re-formation the default group is re-created and its ``local_id_`` is no longer 0: an
out-of-bounds read (issue 35, item 5; read in the torch 2.13 source, not yet seen on a GPU). Here each
dimension's groups come from ``new_group`` (every rank creates every group, in one order, as ``new_group``
requires) and the mesh is assembled with ``DeviceMesh.from_group``; a dimension that spans the whole world
is the default group itself.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def dim_ranks(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """Pure: the rank lists of every group along ``dim`` of a row-major mesh of ``shape`` over ranks
    ``0..prod(shape)-1`` (ranks that differ only in their ``dim`` index), in a fixed order."""
    mesh = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    return mesh.movedim(dim, -1).reshape(-1, shape[dim]).tolist()


def build_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> Any:
    """A ``DeviceMesh`` of ``shape`` over the current world (product = world size), without
    ``split_group`` (see the module docstring)."""
    from torch.distributed.device_mesh import DeviceMesh

    world, rank = dist.get_world_size(), dist.get_rank()
    if int(torch.tensor(shape).prod()) != world:
        raise ValueError(f"a mesh of shape {shape} needs {int(torch.tensor(shape).prod())} ranks; the world has {world}")
    groups = []
    for dim in range(len(shape)):
        mine = None
        for ranks in dim_ranks(shape, dim):
            g = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks=ranks)
            if rank in ranks:
                mine = g
        groups.append(mine)
    mesh = torch.arange(world).reshape(shape)
    if len(shape) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh=mesh, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device_type, mesh=mesh, mesh_dim_names=names)


__all__ = ["build_mesh", "dim_ranks"]
