"""The device mesh and the ONE table that maps logical axis names onto it.

Mesh axes are (data, fsdp, tensor). The batch is split over data × fsdp; parameters are split
over fsdp (ZeRO-3 style, along their 'embed' axis) and tensor (Megatron style, along heads /
MLP width / vocabulary). Changing the parallelism is a change of mesh shape, not of code:

    mesh = make_mesh((1, 8, 1))                      # pure FSDP over 8 devices
    shardings = param_shardings(qwen.logical_axes(cfg), qwen.abstract_params(cfg), mesh)
"""

from __future__ import annotations

import logging
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (None: replicated). The only place this mapping lives.
RULES: dict[str, str | None] = {
    "batch": BATCH_AXES,
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "head_dim": None,
    "norm": None,
    "layers": None,
    "length": None,
    "lora_rank": None,  # a LoRA factor's rank dim (grpo_jax.models.lora); its other dims follow
}


def mesh_shape(shape, num_devices: int) -> tuple[int, int, int]:
  """The (data, fsdp, tensor) extents of `shape` on num_devices devices, -1 resolved: the mesh
  rules, written once (grpo_jax.validate checks config.mesh with them). ValueError naming
  `mesh`."""
  shape = list(shape)
  if len(shape) != 3:
    raise ValueError(f"mesh: needs 3 entries (data, fsdp, tensor), got {tuple(shape)}")
  if not (all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and (s >= 1 or s == -1)
              for s in shape) and shape.count(-1) <= 1):
    raise ValueError(f"mesh: entries must be >= 1, with at most one -1; got {tuple(shape)}")
  shape = [int(s) for s in shape]
  known = math.prod(s for s in shape if s != -1)
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f"mesh: {tuple(shape)} does not divide the {num_devices} devices")
    shape[shape.index(-1)] = num_devices // known
  if math.prod(shape) > num_devices:
    raise ValueError(f"mesh: {tuple(shape)} needs {math.prod(shape)} devices, only "
                     f"{num_devices} present")
  return tuple(shape)


def make_mesh(shape: tuple[int, int, int], devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over the first prod(shape) devices; -1 takes the rest."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(shape, len(devices))
  grid = np.asarray(devices[:math.prod(shape)], dtype=object).reshape(shape)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def _mesh_axes_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return int(np.prod([mesh.shape[a] for a in axes]))


def logical_to_spec(logical: P, shape: tuple[int, ...], mesh: Mesh, name: str = "") -> P:
  """Maps a logical PartitionSpec to a mesh PartitionSpec through RULES.

  A dimension that the mesh axis does not divide is replicated instead (with a log line), so a
  tiny model with 2 kv heads still runs on tensor=4; a mesh axis is used at most once.
  """
  used: set[str] = set()
  out = []
  for dim, axis_name in zip(shape, tuple(logical) + (None,) * (len(shape) - len(logical))):
    if axis_name is not None and axis_name not in RULES:
      raise ValueError(f"{name}: logical axis {axis_name!r} has no rule in sharding.RULES")
    mesh_axes = RULES.get(axis_name) if axis_name else None
    if mesh_axes is not None:
      flat = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
      flat = tuple(a for a in flat if a not in used and mesh.shape[a] > 1)
      size = _mesh_axes_size(mesh, flat)
      if not flat:
        mesh_axes = None
      elif dim % size:
        logging.info("%s: dim %d (%s) not divisible by mesh %s=%d; replicated", name, dim,
                     axis_name, flat, size)
        mesh_axes = None
      else:
        used.update(flat)
        mesh_axes = flat[0] if len(flat) == 1 else flat
    out.append(mesh_axes)
  return P(*out)


def param_shardings(logical_tree, abstract_tree, mesh: Mesh):
  """NamedShardings for a params pytree, from its logical axes and shapes."""
  def one(path, logical, leaf):
    name = jax.tree_util.keystr(path)
    return NamedSharding(mesh, logical_to_spec(logical, leaf.shape, mesh, name))
  return jax.tree_util.tree_map_with_path(
      one, logical_tree, abstract_tree, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Leading (batch) axis split over data × fsdp, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def make_meshes(shape, sample_devices: int = 0, devices=None) -> tuple[Mesh, Mesh | None]:
  """(the training mesh, the sampling mesh or None). sample_devices N > 0 (train.sample_devices,
  one step behind): the first N devices sample, as a (1, N, 1) mesh, and the mesh `shape` trains
  on the devices after them; 0: one mesh `shape` over all of them does both."""
  devices = list(jax.devices() if devices is None else devices)
  if not sample_devices:
    return make_mesh(shape, devices), None
  return (make_mesh(shape, devices[sample_devices:]),
          make_mesh((1, sample_devices, 1), devices[:sample_devices]))


def moved_shardings(tree, mesh: Mesh):
  """Where the arrays of `tree` (placed on another mesh with the same axis names) go on `mesh`:
  each dim keeps its mesh axes where their extent on `mesh` divides it, else is replicated."""
  def one(x):
    spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
    kept = [axes if dim % _mesh_axes_size(mesh, axes) == 0 else None
            for dim, axes in zip(x.shape, spec)]
    return NamedSharding(mesh, P(*kept))
  return jax.tree.map(one, tree)
