"""The public MoE layer: ``mok_jax.moe``.

Validation happens here, at trace time, so that a bad call fails with a
ValueError naming the argument before anything runs. Differentiation is a
custom VJP over the forward and backward primitives (`mok_jax._src.primitives`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._src import ep, paths, primitives, sharding
from mok_jax.recipe import Recipe, check_dtypes, resolve

BACKENDS = ("auto", "fused", "xla")
# Pairs (T * K) one call may have: pair and row numbers are int32 everywhere (the
# statistics, the routing plan, the kernels' row maps; ffi/handlers/decode.h).
MAX_PAIRS = 2**31 - 1
_X_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


class MoEStats(NamedTuple):
    """Routing statistics of one `moe` call (global over the EP group).

    Attributes:
      tokens_per_expert: ``[E]`` int32, valid (token, k) pairs routed to each
        expert, counted before capacity drops.
      dropped: ``[]`` int32, valid pairs removed by the capacity limit.
      invalid: ``[]`` int32, pairs whose expert id is outside ``[0, E)``.
    """

    tokens_per_expert: jax.Array
    dropped: jax.Array
    invalid: jax.Array


def capacity(capacity_factor: float | None, num_tokens: int, top_k: int,
             num_experts: int) -> int | None:
    """Rows each expert keeps: ``min(ceil(capacity_factor * T * K / E), T * K)``,
    or None. Raises ValueError for a token count below 0, K or E below 1, or a
    factor ``moe`` refuses.

    ``num_tokens`` is the global token count (all EP ranks together). An expert
    can receive at most ``T * K`` pairs, so a larger limit would drop nothing; the
    clamp keeps the limit an integer the kernels hold for any finite factor.
    A NumPy scalar factor (``np.float32(1.25)``) gives the limit of the Python
    number of the same value: the product is not rounded in the scalar's dtype.
    """
    for name, value, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1),
                               ("num_experts", num_experts, 1)):
        if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))
                or value < least):
            raise ValueError(f"mok_jax.capacity: {name} must be an int >= {least}, "
                             f"got {value!r}")
    if capacity_factor is None:
        return None
    check_capacity_factor("mok_jax.capacity", capacity_factor)
    if isinstance(capacity_factor, np.generic):
        # NumPy scalars as Python numbers: float32 arithmetic would round the limit.
        capacity_factor = capacity_factor.item()
    pairs = num_tokens * top_k
    if capacity_factor >= num_experts:  # keeps every pair (an int past a float's range too)
        return pairs
    limit = capacity_factor * num_tokens * top_k / num_experts
    if not math.isfinite(limit) or limit >= pairs:
        return pairs
    return int(math.ceil(limit))


def moe(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
        w_gate_up: jax.Array, w_down: jax.Array, *, axis_name: str | None = None,
        capacity_factor: float | None = None, backend: str = "auto",
        recipe: Recipe | str | None = None, return_stats: bool = False,
        check_mesh: bool = True):
    """Mixture-of-Experts layer with SwiGLU experts.

    ``y[t] = sum_k expert_weights[t, k] * FFN_{expert_ids[t, k]}(x[t])`` with
    ``FFN_e(v) = (silu(v @ Wg_e) * (v @ Wu_e)) @ Wd_e``, where ``Wg_e`` and
    ``Wu_e`` are columns ``[0, F)`` and ``[F, 2F)`` of ``w_gate_up[e]``.

    Numerics: GEMMs accumulate in f32; ``h = silu(g) * u`` is computed in f32
    and rounded to ``x.dtype``; each expert's output row is rounded to
    ``x.dtype``; the combine sums over k in ascending order in f32 and rounds
    once. The result is bitwise deterministic.

    Args:
      x: ``[T, H]`` tokens, bfloat16 or float32.
      expert_ids: ``[T, K]`` int32 global expert ids. Ids outside ``[0, E)``
        contribute nothing, get no gradient and are counted as invalid.
      expert_weights: ``[T, K]`` combine weights, float32 or ``x.dtype``.
      w_gate_up: ``[E_local, H, 2F]`` gate and up projections, ``x.dtype``.
      w_down: ``[E_local, F, H]`` down projections, ``x.dtype``.
      axis_name: expert-parallel mesh axis when called inside ``shard_map``
        (``E_local = E / axis_size``; tokens are this rank's shard, ids are
        global). None otherwise: on one device, or under ``jax.jit`` on arrays
        sharded over a mesh (explicit-axis shardings, or any sharding inside
        ``jax.set_mesh``), where the layer is partitioned by
        `mok_jax._src.sharding` (experts dim along the EP axis, tokens along any).
      capacity_factor: None never drops. A float c keeps at most
        ``ceil(c * T * K / E)`` pairs per expert, the lowest token indices
        first; dropped pairs contribute 0 and are counted.
      backend: "fused" (mok_jax's NVLink transport between GPUs under EP; on one
        GPU the layer's CUDA kernels), "xla" (the same local kernels, XLA
        collectives for the exchange) or "auto".
      recipe: how the expert GEMMs compute (static). None (or "native"): in
        x.dtype with f32 accumulation (the numerics above). "fp8": every expert
        GEMM in float8_e4m3fn with f32 block scales and f32 accumulation, for
        bfloat16 x and weights (docs/contract.md, "The fp8 recipe"; a ValueError
        for other dtypes). `mok_jax.Recipe` lists the values.
      return_stats: also return `MoEStats`.
      check_mesh: inside ``jax.shard_map`` (with ``check_vma``), check at trace
        time that the operands vary over the mesh axes as ``axis_name`` says
        (experts split over it and only over it, tokens split over it; no expert
        weights that vary while ``axis_name`` is None). False skips these checks,
        for layouts they cannot tell from mistakes: expert weights all-gathered
        over a data axis inside shard_map (FSDP), or different per pipeline stage.

    Returns:
      ``y`` ``[T, H]`` in ``x.dtype``, or ``(y, MoEStats)``.

    Example:
      >>> import jax, jax.numpy as jnp, mok_jax
      >>> T, K, E, H, F = 8, 2, 4, 16, 32
      >>> ks = jax.random.split(jax.random.key(0), 4)
      >>> x = jax.random.normal(ks[0], (T, H))
      >>> ids = jnp.argsort(jax.random.normal(ks[1], (T, E)), axis=1)[:, :K].astype(jnp.int32)
      >>> w = jnp.full((T, K), 0.5)
      >>> w_gate_up = jax.random.normal(ks[2], (E, H, 2 * F)) * H ** -0.5
      >>> w_down = jax.random.normal(ks[3], (E, F, H)) * F ** -0.5
      >>> mok_jax.moe(x, ids, w, w_gate_up, w_down).shape
      (8, 16)
    """
    _check_static_options(axis_name=axis_name, capacity_factor=capacity_factor,
                          backend=backend, recipe=recipe, return_stats=return_stats,
                          check_mesh=check_mesh)
    recipe = resolve(recipe)
    check_dtypes(recipe, "mok_jax.moe", x=x, w_gate_up=w_gate_up, w_down=w_down)
    num_experts, ep_size = _validate(x, expert_ids, expert_weights, w_gate_up, w_down,
                                     axis_name=axis_name, capacity_factor=capacity_factor,
                                     backend=backend)
    operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
    if check_mesh:
        _check_mesh_axes(operands, axis_name)  # before K <= E: a mesh mistake changes E
    _check_top_k(expert_ids, w_gate_up, num_experts)
    tokens, top_k = expert_ids.shape
    cap = capacity(capacity_factor, tokens * ep_size, top_k, num_experts)
    cap = primitives.NO_CAPACITY if cap is None else cap
    path = _choose_path(backend, axis_name, ep_size, cap, recipe, operands)
    y_sharding = None
    if isinstance(path, ep.ExchangePath) and axis_name is None:  # "xla" on one device
        operands, y_sharding = sharding.without_one_device_mesh(operands)
    with jax.named_scope("mok_jax"):
        # Inside shard_map every operand varies over the same axes (a data-parallel
        # shard_map without axis_name too): the VJP's weight gradients then sum
        # over the axes the weights are replicated on. A no-op outside shard_map.
        operands = primitives.vary_alike(operands)
        y, stats = paths.run(path, *operands)
        if axis_name is not None and ep_size == 1 and isinstance(path, paths.LocalPath):
            # an EP axis of size 1: local stats are global; say so in the type
            stats = tuple(jax.lax.psum(v, axis_name) for v in stats)
    if y_sharding is not None:
        y = jax.sharding.reshard(y, y_sharding)
    if return_stats:
        return y, MoEStats(*stats)
    return y


_STATIC_OPTIONS = ("axis_name", "capacity_factor", "backend", "recipe", "return_stats",
                   "check_mesh")


def _check_top_k(expert_ids, w_gate_up, num_experts: int, where: str = "mok_jax.moe"):
    """A ValueError where the top-k K (expert_ids' columns) exceeds the global E."""
    top_k = expert_ids.shape[1]
    if top_k > num_experts:
        raise ValueError(f"{where}: top-k K={top_k} exceeds the number of experts "
                         f"E={num_experts} (got expert_ids {tuple(expert_ids.shape)}, "
                         f"w_gate_up {tuple(w_gate_up.shape)})")


def _check_static_options(**options):
    """The options choose the computation, so they must be known at trace time."""
    for name, value in options.items():
        if isinstance(value, jax.core.Tracer):
            raise ValueError(
                f"mok_jax.moe: {name} must be a Python value known at trace time, got a "
                f"traced value ({jax.typeof(value).str_short()}). Under jax.jit pass it as a "
                f"static argument: jax.jit(mok_jax.moe, static_argnames={_STATIC_OPTIONS}), "
                f"or close over it (functools.partial(mok_jax.moe, {name}=...)).")
    for name in ("return_stats", "check_mesh"):
        if not isinstance(options[name], (bool, np.bool_, int, np.integer)):
            raise ValueError(f"mok_jax.moe: {name} must be True or False, got "
                             f"{options[name]!r}")
    axis_name = options["axis_name"]
    if axis_name is not None and not isinstance(axis_name, str):
        raise ValueError("mok_jax.moe: axis_name must be None or the name (a str) of one "
                         f"mesh axis, got {axis_name!r}")


def _check_mesh_axes(operands, axis_name):
    """Inside shard_map (with check_vma, its default), the operands' types say which
    mesh axes they vary over; catch the layouts that would run and be wrong.

    * Expert weights that vary over a mesh axis hold different experts per rank:
      that is expert parallelism, and without ``axis_name`` each rank would treat
      its ``E_local`` experts as the whole model.
    * With ``axis_name``, the weights must vary over that axis (each rank holds its
      own ``E / P`` experts) and over no other (replicated over data axes), and
      the tokens must vary over it too: tokens replicated over the EP axis would
      be counted P times (capacity, statistics) and give other results.
    Tokens may vary over any other axes (data parallelism: each shard is its own
    call). ``moe(..., check_mesh=False)`` skips these checks for layouts they
    cannot tell from mistakes (weights all-gathered inside shard_map, FSDP, vary
    over the gathered axis); with ``check_vma=False`` JAX tracks nothing to check.
    """
    names = (a.name for a in primitives.MOE_OPERANDS)
    varying = {n: primitives.varying_axes(jax.typeof(a)) for n, a in zip(names, operands)}
    weights = {n: varying[n] for n in ("w_gate_up", "w_down")}
    if axis_name is None:
        for name, axes in weights.items():
            if axes:
                raise ValueError(
                    f"mok_jax.moe: {name} varies over mesh axis {_fmt(axes)} but axis_name is "
                    "None. If the experts are split over that axis, every rank would take "
                    "its local experts for the whole model: pass axis_name="
                    f"{sorted(axes)[0]!r} for expert parallelism, or replicate the expert "
                    "weights (in_specs P()) for data parallelism. If every rank holds all E "
                    "experts and they only vary in type (e.g. all-gathered inside shard_map, "
                    "FSDP), pass check_mesh=False.")
        return
    if not any(varying.values()):
        return  # shard_map with check_vma=False (or nothing split): nothing to see
    for name, axes in weights.items():
        if axis_name not in axes:
            raise ValueError(
                f"mok_jax.moe: {name} does not vary over axis_name {axis_name!r} (it is "
                "replicated there, e.g. in_specs P()), but expert parallelism needs each rank "
                f"to hold its own E / {jax.lax.axis_size(axis_name)} experts: split the experts "
                f"dim with P({axis_name!r}), or pass axis_name=None for replicated experts.")
        others = axes - {axis_name}
        if others:
            raise ValueError(
                f"mok_jax.moe: {name} also varies over {_fmt(others)}: experts must be split "
                f"over the EP axis {axis_name!r} alone and replicated over the other axes "
                "(check_mesh=False if they only vary in type there, e.g. all-gathered).")
    for name in ("x", "expert_ids"):
        if axis_name not in varying[name]:
            raise ValueError(
                f"mok_jax.moe: {name} does not vary over axis_name {axis_name!r}: every EP "
                "rank would hold the same tokens and the layer would count them once per "
                f"rank (capacity, statistics). Split the tokens over {axis_name!r} (in_specs "
                f"P({axis_name!r}) or P((..., {axis_name!r}))).")


def _fmt(axes) -> str:
    axes = sorted(axes)
    return repr(axes[0]) if len(axes) == 1 else repr(tuple(axes))


def _choose_path(backend, axis_name, ep_size, cap, recipe, operands):
    """The one place where `backend` and the call's context choose how it runs.

    * inside shard_map with an EP axis of size > 1: the EP layer over a transport
      ("xla": XLA's all_to_all; "fused": mok_jax's NVLink transport; "auto": fused
      when `mok_jax.comm.auto_selects_fused` says the mesh allows it, else xla);
    * plain jit on arrays sharded over a mesh: the partitioned layer (each device
      runs the EP layer over the transport the same rule picks, once the
      partitioner has placed the experts);
    * one device (or an EP axis of size 1): "auto" and "fused" run the whole layer
      in one FFI call per pass; "xla" runs the EP layer's pieces (expert FFN and
      combine kernels, plan in XLA) with a trivial exchange -- the same bits.
    """
    if ep_size > 1:
        cfg = ep.Config(axis_name, ep_size, cap, (axis_name,), recipe)
        x = operands[0]
        row_bytes = x.shape[1] * np.dtype(x.dtype).itemsize
        return ep.ExchangePath(cfg, ep.transport_for(backend, _platform(), row_bytes))
    if axis_name is None and sharding.on_a_mesh(operands):
        sharding.check_layout(*operands)
        return sharding.PartitionedPath(cap, recipe, backend, sharding.ep_bound(operands))
    if backend == "xla":
        token_axes = () if axis_name is None else (axis_name,)
        return ep.ExchangePath(ep.Config(axis_name, 1, cap, token_axes, recipe), "xla")
    return paths.LocalPath(cap, recipe)


def _platform() -> str:
    """The platform the call will run on, as far as trace time can tell: the
    context mesh's devices' (shard_map's), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    platform = getattr(getattr(mesh, "abstract_device", None), "platform", None)
    if not mesh.empty and platform:
        return "gpu" if platform in ("cuda", "rocm", "gpu") else platform
    return jax.default_backend()





def check_option_values(where: str, *, capacity_factor, backend) -> None:
    """ValueError (prefixed with `where`) for a `capacity_factor` or `backend` that
    `moe` refuses; shared with layers that take these options (`mok_jax.nn.MoE`)."""
    if backend not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {backend!r}")
    check_capacity_factor(where, capacity_factor)


def check_capacity_factor(where: str, capacity_factor) -> None:
    """ValueError (prefixed with `where`) unless `capacity_factor` is None or a
    positive finite real number (an int is finite at any size)."""
    if capacity_factor is not None and (
            isinstance(capacity_factor, (bool, np.bool_))
            or not isinstance(capacity_factor, (int, float, np.integer, np.floating))
            or not (isinstance(capacity_factor, (int, np.integer))
                    or math.isfinite(capacity_factor))
            or capacity_factor <= 0):
        raise ValueError(f"{where}: capacity_factor must be None (never drop) or a positive "
                         f"finite number, got {capacity_factor!r}")


def _shape(a) -> tuple[int, ...]:
    return tuple(np.shape(a))


def _validate(x, expert_ids, expert_weights, w_gate_up, w_down, *, axis_name,
              capacity_factor, backend, where="mok_jax.moe") -> tuple[int, int]:
    """Checks every static property of a call; returns (global experts, EP size).
    The messages start with `where`."""
    shapes = (f"x {_shape(x)}, expert_ids {_shape(expert_ids)}, expert_weights "
              f"{_shape(expert_weights)}, w_gate_up {_shape(w_gate_up)}, "
              f"w_down {_shape(w_down)}")

    def fail(msg):
        raise ValueError(f"{where}: {msg} (got {shapes})")

    operands = (x, expert_ids, expert_weights, w_gate_up, w_down)
    for array, a in zip(primitives.MOE_OPERANDS, operands):
        name, rank = array.name, len(array.dims)
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            fail(f"{name} must be an array (jax or numpy), got {type(a).__name__}")
        if np.ndim(a) != rank:
            fail(f"{name} must have rank {rank}, got rank {np.ndim(a)}")

    x_dtype = np.dtype(x.dtype)
    if x_dtype not in _X_DTYPES:
        fail(f"x must be float32 or bfloat16, got {x_dtype}")
    if np.dtype(expert_ids.dtype) != np.dtype(np.int32):
        fail(f"expert_ids must be int32, got {np.dtype(expert_ids.dtype)}")
    if np.dtype(expert_weights.dtype) not in (np.dtype(np.float32), x_dtype):
        fail(f"expert_weights must be float32 or x.dtype ({x_dtype}), "
             f"got {np.dtype(expert_weights.dtype)}")
    for name, a in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if np.dtype(a.dtype) != x_dtype:
            fail(f"{name} must have x.dtype ({x_dtype}), got {np.dtype(a.dtype)}")

    tokens, hidden = x.shape
    if expert_ids.shape[0] != tokens:
        fail(f"expert_ids has {expert_ids.shape[0]} rows but x has {tokens} tokens")
    if expert_weights.shape != expert_ids.shape:
        fail("expert_weights must have the shape of expert_ids [T, K]")
    top_k = expert_ids.shape[1]
    if top_k < 1:
        fail("expert_ids must have at least one column (K >= 1)")
    if tokens * top_k > MAX_PAIRS:
        fail(f"T * K = {tokens * top_k} (token, k) pairs exceed {MAX_PAIRS} (2^31 - 1): "
             "the routing plan, its statistics and the kernels' row indices are int32")
    if hidden < 1:
        fail("x must have a hidden dimension H >= 1")
    experts_local, wgu_hidden, two_f = w_gate_up.shape
    if wgu_hidden != hidden:
        fail(f"w_gate_up's hidden dimension {wgu_hidden} does not match x's {hidden}")
    if two_f % 2 or two_f == 0:
        fail(f"w_gate_up's last dimension must be 2F with F >= 1, got {two_f}")
    ffn = two_f // 2
    if w_down.shape != (experts_local, ffn, hidden):
        fail(f"w_down must be [E_local, F, H] = {(experts_local, ffn, hidden)} to match "
             "w_gate_up and x")
    if experts_local < 1:
        fail("w_gate_up must hold at least one expert")

    check_option_values(where, capacity_factor=capacity_factor, backend=backend)
    if backend == "fused" and jax.default_backend() != "gpu":
        raise ValueError("mok_jax.moe: backend='fused' needs a CUDA GPU; on "
                         f"{jax.default_backend()!r} use backend='xla' or 'auto'")

    ep_size = 1
    if axis_name is not None:
        unbound = (f"mok_jax.moe: axis_name={axis_name!r} is not a bound mesh axis; call "
                   "moe inside jax.shard_map over a mesh with that axis, or pass "
                   "axis_name=None")
        try:
            ep_size = jax.lax.axis_size(axis_name)
        except NameError as err:
            raise ValueError(unbound) from err
        # jax.vmap(..., axis_name=...) binds a name too, but its batch elements are
        # independent calls, not EP ranks (and the custom VJP's backward cannot see it).
        if axis_name not in jax.sharding.get_abstract_mesh().manual_axes:
            raise ValueError(f"{unbound} (it names a jax.vmap axis: under vmap every "
                             "batch element is its own moe call)")
    return experts_local * ep_size, ep_size
