"""Flax NNX Mixture-of-Experts layer on top of `mok_jax.moe`.

`MoE` holds a router (``nnx.Linear``, f32 math), ``E`` SwiGLU experts as two
stacked parameters ``[E, H, 2F]`` / ``[E, F, H]``, an optional shared expert and
an optional DeepSeek-V3 style balancing bias. Its ``__call__`` returns
``(y, MoEAux)``: the layer output and the router's auxiliary values
(load-balancing loss, z-loss, tokens per expert, dropped pairs).

Sharding is parameter metadata in *logical* axes (``nnx.with_partitioning``):

    router.kernel   [H, E]       ("embed", None)
    w_gate_up       [E, H, 2F]   ("expert", "embed", "mlp")
    w_down          [E, F, H]    ("expert", "mlp", "embed")
    shared_gate_up  [H, 2Fs]     ("embed", "mlp")
    shared_down     [Fs, H]      ("mlp", "embed")
    balance_bias    [E]          replicated

`logical_axis_rules` maps them onto a mesh: ``"expert"`` to the expert-parallel
axis ``"ep"``, ``"batch"`` (tokens) to every data axis (``"dp"`` and ``"ep"``:
tokens are sharded over all devices), everything else replicated. Under
``jax.jit`` with parameters placed by those rules, expert parallelism is the
business of `mok_jax.moe`'s sharding rule; inside ``jax.shard_map`` pass
``axis_name`` (and ``batch_axis_names``) so that the layer calls ``moe`` with the
EP axis and makes its statistics global.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import flax.core.spmd
import numpy as np
from flax import nnx

import mok_jax
from mok_jax._src import primitives
from mok_jax.moe import check_option_values
from mok_jax.recipe import Recipe
from mok_jax.recipe import resolve as resolve_recipe
from mok_jax.router import ROUTER_DOTS, router_logits, top_k as router_top_k

SCORE_FUNCTIONS = ("softmax", "sigmoid")

#: Logical axis -> mesh axis, for a mesh with axes ``("dp", "ep")``. Use
#: `logical_axis_rules` for meshes that lack one of them.
LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("dp", "ep")),
    ("expert", "ep"),
    ("embed", None),
    ("mlp", None),
    ("heads", None),
    ("vocab", None),
)


def logical_axis_rules(mesh_axis_names: Sequence[str], *, expert_axis: str = "ep",
                       data_axes: Sequence[str] = ("dp", "ep")) -> tuple[tuple[str, Any], ...]:
    """Logical axis rules for a mesh with the given axis names.

    ``"batch"`` (tokens) goes to every axis of ``data_axes`` the mesh has,
    ``"expert"`` to ``expert_axis`` if the mesh has it; the other logical axes of
    `LOGICAL_AXIS_RULES` are replicated. Use with ``nnx.logical_axis_rules`` or
    ``nnx.get_partition_spec``.

    Example:
      >>> logical_axis_rules(("dp",))[:2]
      (('batch', ('dp',)), ('expert', None))
    """
    for name, value in (("mesh_axis_names", mesh_axis_names), ("data_axes", data_axes)):
        if isinstance(value, str):
            raise ValueError(f"logical_axis_rules: {name} must be a sequence of mesh axis "
                             f"names, such as ({value!r},), got the str {value!r}")
    names = tuple(mesh_axis_names)
    batch = tuple(a for a in data_axes if a in names)
    rules = {name: target for name, target in LOGICAL_AXIS_RULES}
    rules["batch"] = batch or None
    rules["expert"] = expert_axis if expert_axis in names else None
    return tuple(rules.items())


def named_shardings(tree: Any, mesh: jax.sharding.Mesh, *,
                    rules: Sequence[tuple[str, Any]] | None = None) -> Any:
    """``NamedSharding`` for every array of ``tree`` from its logical metadata.

    ``tree`` is an ``nnx.State`` (or any pytree holding nnx Variables, such as an
    optax state over ``nnx.State`` parameters); arrays without metadata are
    replicated. ``rules`` defaults to ``logical_axis_rules(mesh.axis_names)``.
    The result has the structure of ``tree``: use it for ``jax.device_put`` or
    as ``in_shardings``/``out_shardings`` of ``jax.jit``.
    """
    rules = logical_axis_rules(mesh.axis_names) if rules is None else tuple(rules)
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(tree)
    return jax.tree.map(lambda spec: jax.sharding.NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


class BalanceBias(nnx.Variable):
    """Per-expert routing bias ``[E]`` f32 for auxiliary-loss-free balancing.

    Not an ``nnx.Param``: optimizers built with ``wrt=nnx.Param`` leave it alone;
    `MoE.update_balance_bias` changes it from routing counts.
    """


class MoEAux(NamedTuple):
    """Auxiliary outputs of one `MoE` call (global over the batch).

    Attributes:
      aux_loss: ``[]`` f32 load-balancing loss ``E * sum_e f_e * p_e`` (Switch /
        GShard), where ``f_e`` is the fraction of routed (token, k) pairs that
        chose expert e (``sum_e f_e = 1``; not differentiated) and ``p_e`` the
        mean over tokens of the router probability of e. Equals 1 for perfectly
        balanced routing, whatever K; E / K when every token puts all of its
        probability on one expert and that expert among its K choices.
      z_loss: ``[]`` f32 router z-loss ``mean_t logsumexp(logits_t) ** 2``.
        Both losses are 0 for a call with no tokens (rather than a mean over
        nothing, NaN, which would poison the sum it is added to).
      tokens_per_expert: ``[E]`` int32 pairs routed to each expert (before
        capacity drops), from `mok_jax.MoEStats`.
      dropped: ``[]`` int32 pairs dropped by the capacity limit.
    """

    aux_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array


_LECUN_NORMAL = nnx.initializers.lecun_normal()


def _expert_init(fan_in_axis: int):
    # LeCun normal per expert: the experts axis is a batch axis, not a fan.
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=fan_in_axis, out_axis=-1, batch_axis=(0,))


def logical_partitioning(init: nnx.Initializer, axes: tuple) -> nnx.Initializer:
    """``init`` with logical sharding metadata (``nnx.with_partitioning``).

    Flax shards a variable at creation when a mesh is active (eager sharding);
    without a mesh that would fail, so the metadata is then kept for later
    (``nnx.get_partition_spec``) without sharding eagerly.
    """
    if jax.sharding.get_abstract_mesh().empty:
        return nnx.with_partitioning(init, axes, eager_sharding=False)
    return nnx.with_partitioning(init, axes)


_SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, (bool, np.bool_)))


def _real_array(where: str, name: str, value, what: str):
    """``value`` as an array of an integer or floating dtype, or a ValueError naming
    ``name`` (for strings, complex numbers, booleans, None)."""
    try:
        array = value if isinstance(value, jax.Array) else np.asarray(value)
    except (TypeError, ValueError):
        array = None
    if array is None or not (jnp.issubdtype(array.dtype, jnp.integer)
                             or jnp.issubdtype(array.dtype, jnp.floating)):
        raise ValueError(f"{where}: {name} must be {what} (an integer or floating "
                         f"scalar or array), got {value!r}")
    return jnp.asarray(array)


def _as_dtype(name: str, value) -> np.dtype:
    """``value`` as a dtype that `mok_jax.moe` supports, or a ValueError naming ``name``."""
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError:
        dtype = None
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(
            f"MoE: {name} must be float32 or bfloat16, got {value!r}: the layer's experts "
            "run through mok_jax.moe, which supports only these two dtypes")
    return dtype


def _expert_mesh_axes(axis_name) -> tuple[str, ...]:
    """The mesh axes the experts dimension is sharded over when the layer is built:
    ``axis_name`` (shard_map), else the axes the active logical axis rules map
    ``"expert"`` to (Flax shards new parameters eagerly under ``jax.set_mesh``)."""
    if axis_name is not None:
        return (axis_name,)
    target = dict(flax.core.spmd.get_logical_axis_rules() or ()).get("expert")
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def _check_experts_split(num_experts, axis_name) -> None:
    """Under an active mesh: num_experts must split evenly over the EP axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return
    axes = [a for a in _expert_mesh_axes(axis_name) if a in mesh.axis_names]
    ep_size = math.prod(mesh.shape[a] for a in axes)
    if num_experts % ep_size:
        raise ValueError(
            f"MoE: num_experts={num_experts} does not split over the expert-parallel mesh "
            f"axis {'x'.join(axes)!r} of size {ep_size} (the current mesh): each device must hold "
            "num_experts / EP axis size experts, so local experts x EP axis size == num_experts")


def _check_config(*, hidden_size, ffn_size, num_experts, top_k, score_fn, renormalize,
                  route_scale, balance_bias, shared_ffn_size, capacity_factor, axis_name,
                  batch_axis_names, backend, recipe, router_dot, dtype, param_dtype,
                  router_kernel_init, expert_kernel_init, check_mesh, rngs) -> None:
    """Every constructor argument of `MoE`, checked before any parameter is made:
    a ValueError naming the argument."""
    for name, value in (("hidden_size", hidden_size), ("ffn_size", ffn_size),
                        ("num_experts", num_experts), ("top_k", top_k)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"MoE: {name} must be a positive int, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"MoE: top_k={top_k} exceeds num_experts={num_experts}")
    if not _is_int(shared_ffn_size) or shared_ffn_size < 0:
        raise ValueError(f"MoE: shared_ffn_size must be an int >= 0 (0: no shared expert), "
                         f"got {shared_ffn_size!r}")
    if score_fn not in SCORE_FUNCTIONS:
        raise ValueError(f"MoE: score_fn must be one of {SCORE_FUNCTIONS}, got {score_fn!r}")
    for name, value in (("renormalize", renormalize), ("balance_bias", balance_bias),
                        ("check_mesh", check_mesh)):
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"MoE: {name} must be a bool, got {value!r}")
    try:
        scale_ok = _is_real(route_scale) and math.isfinite(route_scale) and route_scale > 0
    except OverflowError:  # an int past a float's range: the layer keeps float(route_scale)
        scale_ok = False
    if not scale_ok:
        raise ValueError(f"MoE: route_scale must be a positive finite number, got {route_scale!r}")
    check_option_values("MoE", capacity_factor=capacity_factor, backend=backend)
    if dtype is not None:
        _as_dtype("dtype", dtype)
    _as_dtype("param_dtype", param_dtype)
    if resolve_recipe(recipe, where="MoE") == Recipe.FP8:
        if dtype is not None and jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"MoE: recipe 'fp8' needs bfloat16 dtype (the experts' "
                             f"computation dtype); got {jnp.dtype(dtype)}")
        if dtype is None and _as_dtype("param_dtype", param_dtype) != jnp.dtype(jnp.bfloat16):
            raise ValueError(f"MoE: recipe 'fp8' needs bfloat16 dtype (the experts' "
                             f"computation dtype); dtype=None infers it from the input "
                             f"and param_dtype={jnp.dtype(param_dtype)}, which would make "
                             f"it {jnp.dtype(param_dtype)}: pass dtype=jnp.bfloat16")
    if router_dot not in ROUTER_DOTS:
        raise ValueError(f"MoE: router_dot must be one of {ROUTER_DOTS}, got {router_dot!r}")

    if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
        raise ValueError("MoE: axis_name must be None or the name (str) of the expert-parallel "
                         f"mesh axis, got {axis_name!r}")
    if isinstance(batch_axis_names, str) or not isinstance(batch_axis_names, Sequence) or not all(
            isinstance(a, str) and a for a in batch_axis_names):
        raise ValueError("MoE: batch_axis_names must be a sequence of mesh axis names (str), "
                         f"such as ('dp', 'ep'), got {batch_axis_names!r}")
    if len(set(batch_axis_names)) != len(batch_axis_names):
        raise ValueError(f"MoE: batch_axis_names has a repeated axis: {tuple(batch_axis_names)}")
    if axis_name is not None and axis_name not in batch_axis_names:
        raise ValueError(
            f"MoE: batch_axis_names={tuple(batch_axis_names)} must include axis_name="
            f"{axis_name!r}: inside jax.shard_map the tokens are sharded over the expert-parallel "
            "axis too, and the auxiliary losses and statistics are reduced over "
            "batch_axis_names (e.g. batch_axis_names=('dp', 'ep'))")
    _check_experts_split(num_experts, axis_name)

    if not callable(router_kernel_init):
        raise ValueError(f"MoE: router_kernel_init must be an initializer (a callable), "
                         f"got {router_kernel_init!r}")
    if expert_kernel_init is not None and not callable(expert_kernel_init):
        raise ValueError(f"MoE: expert_kernel_init must be None or an initializer (a callable), "
                         f"got {expert_kernel_init!r}")
    # hasattr: a 'params' stream, or the 'default' stream Flax falls back to.
    if not isinstance(rngs, nnx.Rngs) or not hasattr(rngs, "params"):
        raise ValueError(f"MoE: rngs must be an nnx.Rngs (with a 'params' stream), got {rngs!r}")


class MoE(nnx.Module):
    """Mixture-of-Experts SwiGLU layer: router, top-k, ``mok_jax.moe``.

    Per token ``x_t`` (``[H]``): router logits ``l_t = x_t @ W_r`` in f32;
    scores ``s_t = softmax(l_t)`` or ``sigmoid(l_t)``; the K experts with the
    largest ``s_t + balance_bias`` are selected (the bias only selects); their
    weights are ``s_t[ids]``, divided by their sum if ``renormalize``, times
    ``route_scale``; then ``y_t = sum_k w_tk FFN_{id_tk}(x_t)`` (+ the shared
    expert's ``FFN_s(x_t)``) with ``FFN(v) = (silu(v @ Wg) * (v @ Wu)) @ Wd``.

    Router math (logits, scores, top-k, weights, aux losses) is f32 at f32
    accuracy (`mok_jax.router.router_logits`); experts run in ``dtype`` (float32 or
    bfloat16).

    Args:
      hidden_size: H, the model width.
      ffn_size: F, the hidden width of each expert.
      num_experts: E, global number of experts.
      top_k: K, experts per token (``1 <= K <= E``).
      score_fn: "softmax" (Switch, Mixtral) or "sigmoid" (DeepSeek-V3).
      renormalize: divide the K selected scores by their sum (Mixtral, Qwen,
        DeepSeek-V3), computed as the softmax of their logits (softmax) or
        log-sigmoids (sigmoid): the same values, and finite where a balance
        bias selects scores that underflow to 0. With K = 1 this makes every
        weight 1 and the router gets no gradient from the output, only from
        the auxiliary losses.
      route_scale: constant factor on the combine weights (DeepSeek-V3: 2.5).
      balance_bias: keep a `BalanceBias` ``[E]`` added to the scores for
        selection only, updated by `update_balance_bias` (auxiliary-loss-free
        balancing, DeepSeek-V3).
      shared_ffn_size: hidden width of an always-on shared SwiGLU expert
        (0: none).
      capacity_factor: passed to `mok_jax.moe` (None: never drop).
      axis_name: expert-parallel mesh axis, only when the layer is called
        inside ``jax.shard_map`` (parameters are then the local shards, ``E/P``
        experts). None under ``jax.jit``, where sharded parameters are handled
        by ``moe``'s sharding rule.
      batch_axis_names: inside ``shard_map``, every mesh axis the tokens are
        sharded over (usually ``("dp", "ep")``; it must include ``axis_name``).
        `MoEAux` is then reduced over them, so it is global, as under
        ``jax.jit``.
      backend: passed to `mok_jax.moe`.
      recipe: how the expert GEMMs compute, passed to `mok_jax.moe` (None: in the
        computation dtype, f32 accumulation; "fp8": float8_e4m3fn with block
        scales, for a bfloat16 computation dtype).
      router_dot: how the f32 router logits are computed (`mok_jax.router.router_logits`):
        "auto" (bf16 tensor-core products, exact, for bfloat16 inputs; XLA's f32
        ``HIGHEST`` dot otherwise) or "highest" (always XLA's f32 dot). The two
        agree to f32 rounding.
      dtype: computation dtype of the experts (float32 or bfloat16); None
        infers it from the input and ``param_dtype``.
      param_dtype: dtype of every parameter.
      router_kernel_init, expert_kernel_init: initializers (default LeCun
        normal; for experts with the experts axis as a batch axis).
      check_mesh: passed to `mok_jax.moe` (False skips its shard_map mesh checks,
        e.g. for expert weights all-gathered inside shard_map).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Every argument is checked at construction (ValueError naming it). Each call
    checks that the experts it holds add up to ``num_experts``: all of them with
    ``axis_name=None``, ``num_experts / P`` per device inside ``shard_map`` over
    an EP axis of size P.

    Call: ``y, aux = layer(x)`` with ``x`` ``[..., H]`` (any leading shape,
    flattened to tokens), ``y`` ``[..., H]`` in the computation dtype and
    ``aux`` a `MoEAux`. The auxiliary values are returned rather than sown, so
    the layer works the same under ``jax.jit``, ``jax.grad``, ``shard_map``,
    remat and ``nnx.scan`` with no ``nnx.capture``/``nnx.pop`` step; add
    ``coef * aux.aux_loss`` and ``coef * aux.z_loss`` to the training loss.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from flax import nnx
      >>> from mok_jax.nn import MoE
      >>> layer = MoE(hidden_size=16, ffn_size=32, num_experts=4, top_k=2,
      ...             rngs=nnx.Rngs(0))
      >>> layer.w_gate_up.shape, layer.w_down.shape
      ((4, 16, 64), (4, 32, 16))
      >>> x = jax.random.normal(jax.random.key(1), (2, 8, 16))
      >>> y, aux = layer(x)
      >>> y.shape, aux.tokens_per_expert.shape, int(aux.tokens_per_expert.sum())
      ((2, 8, 16), (4,), 32)
      >>> def loss(layer, x):
      ...     y, aux = layer(x)
      ...     return jnp.mean(y ** 2) + 1e-2 * aux.aux_loss + 1e-3 * aux.z_loss
      >>> grads = nnx.grad(loss)(layer, x)
      >>> grads.w_gate_up.shape
      (4, 16, 64)
    """

    def __init__(self, *, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 score_fn: str = "softmax", renormalize: bool = False,
                 route_scale: float = 1.0, balance_bias: bool = False,
                 shared_ffn_size: int = 0, capacity_factor: float | None = None,
                 axis_name: str | None = None, batch_axis_names: Sequence[str] = (),
                 backend: str = "auto", recipe: Recipe | str | None = None,
                 router_dot: str = "auto", dtype: Any = None,
                 param_dtype: Any = jnp.float32, router_kernel_init: nnx.Initializer = _LECUN_NORMAL,
                 expert_kernel_init: nnx.Initializer | None = None,
                 check_mesh: bool = True, rngs: nnx.Rngs):
        _check_config(hidden_size=hidden_size, ffn_size=ffn_size, num_experts=num_experts,
                      top_k=top_k, score_fn=score_fn, renormalize=renormalize,
                      route_scale=route_scale, balance_bias=balance_bias,
                      shared_ffn_size=shared_ffn_size, capacity_factor=capacity_factor,
                      axis_name=axis_name, batch_axis_names=batch_axis_names, backend=backend,
                      recipe=recipe, router_dot=router_dot, dtype=dtype, param_dtype=param_dtype,
                      router_kernel_init=router_kernel_init,
                      expert_kernel_init=expert_kernel_init, check_mesh=check_mesh, rngs=rngs)
        self.check_mesh = bool(check_mesh)
        self.hidden_size = int(hidden_size)
        self.ffn_size = int(ffn_size)
        self.num_experts = int(num_experts)
        self.top_k = int(top_k)
        self.score_fn = score_fn
        self.renormalize = bool(renormalize)
        self.route_scale = float(route_scale)
        self.shared_ffn_size = int(shared_ffn_size)
        self.capacity_factor = capacity_factor
        self.axis_name = axis_name
        self.batch_axis_names = tuple(batch_axis_names)
        self.backend = backend
        self.recipe = resolve_recipe(recipe, where="MoE")
        self.router_dot = router_dot
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)

        H, F, E = self.hidden_size, self.ffn_size, self.num_experts
        # The router's parameter (``router.kernel``); the layer computes its logits
        # with `mok_jax.router.router_logits`, not by calling this Linear.
        self.router = nnx.Linear(
            H, E, use_bias=False, dtype=jnp.float32, param_dtype=param_dtype,
            precision=jax.lax.Precision.HIGHEST,
            kernel_init=logical_partitioning(router_kernel_init, ("embed", None)), rngs=rngs)
        gate_up_init = expert_kernel_init or _expert_init(fan_in_axis=1)
        down_init = expert_kernel_init or _expert_init(fan_in_axis=1)
        self.w_gate_up = nnx.Param(logical_partitioning(gate_up_init, ("expert", "embed", "mlp"))(
            rngs.params(), (E, H, 2 * F), param_dtype))
        self.w_down = nnx.Param(logical_partitioning(down_init, ("expert", "mlp", "embed"))(
            rngs.params(), (E, F, H), param_dtype))
        for init_name, name, param, shape in (
                ("router_kernel_init", "router.kernel", self.router.kernel, (H, E)),
                ("expert_kernel_init", "w_gate_up", self.w_gate_up, (E, H, 2 * F)),
                ("expert_kernel_init", "w_down", self.w_down, (E, F, H))):
            if param.shape != shape or param.dtype != self.param_dtype:
                raise ValueError(
                    f"MoE: {init_name} made {name} of shape {param.shape} and dtype "
                    f"{param.dtype}, expected {shape} and {self.param_dtype} (param_dtype): "
                    "an initializer is called as init(key, shape, dtype)")
        if self.shared_ffn_size:
            Fs = self.shared_ffn_size
            dense_init = _LECUN_NORMAL
            self.shared_gate_up = nnx.Param(logical_partitioning(dense_init, ("embed", "mlp"))(
                rngs.params(), (H, 2 * Fs), param_dtype))
            self.shared_down = nnx.Param(logical_partitioning(dense_init, ("mlp", "embed"))(
                rngs.params(), (Fs, H), param_dtype))
        else:
            self.shared_gate_up = nnx.data(None)
            self.shared_down = nnx.data(None)
        if balance_bias:
            self.balance_bias = BalanceBias(jnp.zeros((E,), jnp.float32))
        else:
            self.balance_bias = nnx.data(None)

    # --- routing -------------------------------------------------------------

    def route(self, tokens: jax.Array):
        """Routes ``tokens`` ``[T, H]``.

        Returns ``(expert_ids [T, K] int32, expert_weights [T, K] f32,
        logits [T, E] f32, probs [T, E] f32)`` where ``probs`` rows sum to 1
        (softmax, or sigmoid scores normalised per token) and feed the
        load-balancing loss.
        """
        kernel = self.router.kernel[...]
        if kernel.shape != (self.hidden_size, self.num_experts):
            raise ValueError(
                f"MoE: router.kernel has shape {kernel.shape}, expected (hidden_size, "
                f"num_experts) = ({self.hidden_size}, {self.num_experts}), whole on every "
                "device")
        logits = router_logits(tokens, kernel, self.router_dot)
        if self.score_fn == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
            probs = scores
        else:
            scores = jax.nn.sigmoid(logits)
            # s / sum(s) from log-sigmoids: the same values, and finite where every
            # sigmoid of a token underflows to 0 (logits below about -87).
            probs = jax.nn.softmax(jax.nn.log_sigmoid(logits), axis=-1)
        # Both score functions increase with the logit, so the top scores are the top
        # logits; selecting on the logits keeps scores that round to the same float
        # (or underflow to 0) in their logits' order. The bias adds to the scores.
        select = logits
        if self.balance_bias is not None:
            select = scores + jax.lax.stop_gradient(self.balance_bias[...])
        expert_ids, weights = router_top_k(select, scores, self.top_k)
        if self.renormalize:
            # s_i / sum(s) over the picked scores is the softmax of their logs (up
            # to a constant: the logits for softmax, the log-sigmoids for sigmoid):
            # finite where every picked score underflows to 0 (a balance bias, or
            # sigmoid logits below about -87), and exactly 1, with no gradient, at
            # K = 1.
            log_scores = logits if self.score_fn == "softmax" else jax.nn.log_sigmoid(logits)
            _, picked = router_top_k(select, log_scores, self.top_k)
            weights = jax.nn.softmax(picked, axis=-1)
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        return expert_ids, weights, logits, probs

    # --- forward -------------------------------------------------------------

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoEAux]:
        """``x`` ``[..., H]`` -> ``(y [..., H], MoEAux)``; see the class docstring."""
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            raise ValueError(f"MoE: x must be real, got {x.dtype}: casting it to the "
                             "computation dtype would drop the imaginary parts")
        if x.ndim == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoE: x's last dimension must be hidden_size={self.hidden_size}, "
                             f"got shape {x.shape}")
        self._check_expert_placement()
        self._check_token_axes(x)
        lead = x.shape[:-1]
        tokens = x.reshape(-1, self.hidden_size)
        with jax.named_scope("router"):  # profiles group the routing under this name
            expert_ids, weights, logits, probs = self.route(tokens)

        w_gate_up, w_down = self.w_gate_up[...], self.w_down[...]
        dtype = (self.dtype if self.dtype is not None
                 else jnp.result_type(tokens.dtype, w_gate_up.dtype, w_down.dtype))
        xt, w_gate_up, w_down = (a.astype(dtype) for a in (tokens, w_gate_up, w_down))
        y, stats = mok_jax.moe(xt, expert_ids, weights, w_gate_up, w_down,
                               axis_name=self.axis_name, capacity_factor=self.capacity_factor,
                               backend=self.backend, recipe=self.recipe, return_stats=True,
                               check_mesh=self.check_mesh)
        if self.shared_gate_up is not None:
            y = y + self._shared_expert(xt)
        with jax.named_scope("router"):
            aux = self._aux(logits, probs, stats)
        return y.reshape(*lead, self.hidden_size), aux

    def _check_token_axes(self, x) -> None:
        """Inside ``shard_map`` with JAX's tracking of varying axes (``check_vma``),
        ``x`` must vary over every axis in ``batch_axis_names``: `MoEAux` is summed
        over them, and copies of the same tokens would be counted once per copy."""
        vma = primitives.varying_axes(jax.typeof(x))
        # An axis index varies over its axis exactly when JAX tracks varying axes
        # there (check_vma=True); with check_vma=False nothing can be compared.
        tracked = [a for a in self.batch_axis_names
                   if a in primitives.varying_axes(jax.typeof(jax.lax.axis_index(a)))]
        missing = tuple(a for a in tracked if a not in vma)
        if missing:
            raise ValueError(
                f"MoE: batch_axis_names={self.batch_axis_names} includes {missing}, but x is "
                f"not split over {'it' if len(missing) == 1 else 'them'} (it varies over "
                f"{tuple(sorted(vma))} only): the statistics and losses would count the same "
                "tokens once per copy. Split the tokens over those axes in shard_map's "
                "in_specs, or leave them out of batch_axis_names")

    def _check_expert_placement(self) -> None:
        """The experts this call holds must add up to ``num_experts``: all of them
        (``axis_name=None``) or ``num_experts / P`` on each of the P devices of the
        EP axis (inside ``shard_map``). Otherwise the routing ids (global, in
        ``[0, num_experts)``) would not match the experts `mok_jax.moe` sees.
        The named mesh axes must be bound (inside ``shard_map``)."""
        local = self.w_gate_up.shape[0]
        E = self.num_experts
        ep_size = 1
        if self.axis_name is not None:
            try:
                ep_size = jax.lax.axis_size(self.axis_name)
            except NameError as err:
                raise ValueError(
                    f"MoE: axis_name={self.axis_name!r} is not a bound mesh axis: call the "
                    "layer inside jax.shard_map over a mesh with that axis, or build it with "
                    "axis_name=None to run under jax.jit") from err
        for axis in self.batch_axis_names:
            try:
                jax.lax.axis_size(axis)
            except NameError as err:
                raise ValueError(
                    f"MoE: batch_axis_names names {axis!r}, which is not a bound mesh axis: "
                    "call the layer inside jax.shard_map over a mesh with that axis, or build "
                    "it with batch_axis_names=() to run under jax.jit") from err
        if self.axis_name is None and local != E:
            raise ValueError(
                f"MoE: the layer holds {local} experts (w_gate_up {self.w_gate_up.shape}) "
                f"but num_experts={E}. Inside jax.shard_map with the experts sharded over "
                "a mesh axis, build the layer with axis_name=<that axis>; under jax.jit "
                "pass the whole (sharded) parameters")
        if local * ep_size != E:
            hint = (f"each device must hold num_experts / {ep_size} = {E // ep_size} experts: "
                    f"shard w_gate_up and w_down over {self.axis_name!r} along their first "
                    "(experts) dimension" if E % ep_size == 0 else
                    f"num_experts={E} is not divisible by the EP axis size {ep_size}")
            raise ValueError(
                f"MoE: local experts x EP axis size must equal num_experts, got {local} "
                f"local experts (w_gate_up {self.w_gate_up.shape}) x {ep_size} (mesh axis "
                f"{self.axis_name!r}) = {local * ep_size} != num_experts={E}; {hint}")

    def _shared_expert(self, x: jax.Array) -> jax.Array:
        wgu, wd = (w.astype(x.dtype) for w in (self.shared_gate_up[...], self.shared_down[...]))
        gate_up = jnp.dot(x, wgu, preferred_element_type=jnp.float32)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        return jnp.dot(h, wd, preferred_element_type=jnp.float32).astype(x.dtype)

    def _aux(self, logits, probs, stats: mok_jax.MoEStats) -> MoEAux:
        tokens_local = logits.shape[0]
        # moe's statistics are already global over the EP axis; the other token
        # axes of a shard_map are summed here.
        other_axes = tuple(a for a in self.batch_axis_names if a != self.axis_name)
        tokens_per_expert, dropped = stats.tokens_per_expert, stats.dropped
        shards = 1
        if self.batch_axis_names:
            shards = math.prod(jax.lax.axis_size(a) for a in self.batch_axis_names)
        if other_axes:
            tokens_per_expert = jax.lax.psum(tokens_per_expert, other_axes)
            dropped = jax.lax.psum(dropped, other_axes)

        if tokens_local == 0:  # static: every shard has no tokens
            zero = jnp.zeros((), jnp.float32)
            return MoEAux(aux_loss=zero, z_loss=zero, tokens_per_expert=tokens_per_expert,
                          dropped=dropped)
        routed_fraction = tokens_per_expert.astype(jnp.float32) / (
            tokens_local * shards * self.top_k)
        mean_prob = jnp.mean(probs, axis=0)
        z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
        if self.batch_axis_names:
            # Equal token counts per shard: the mean of the shard means is the mean.
            mean_prob = jax.lax.pmean(mean_prob, self.batch_axis_names)
            z = jax.lax.pmean(z, self.batch_axis_names)
        aux_loss = self.num_experts * jnp.sum(routed_fraction * mean_prob)
        return MoEAux(aux_loss=aux_loss, z_loss=z, tokens_per_expert=tokens_per_expert,
                      dropped=dropped)

    # --- balancing -----------------------------------------------------------

    def update_balance_bias(self, tokens_per_expert: jax.Array, rate: float | jax.Array) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3):
        ``bias_e += rate * sign(mean(counts) - counts_e)``.

        Overloaded experts become less likely to be selected, underloaded ones
        more. Call once per training step with the global ``tokens_per_expert``
        ``[E]`` of `MoEAux` (sum them first if the layer ran on several
        micro-batches); ``rate`` is a scalar, or ``[E]`` for a rate per expert,
        finite and >= 0 (a concrete rate outside that is a ValueError).
        Works eagerly and under ``jax.jit``.
        """
        if self.balance_bias is None:
            raise ValueError("MoE.update_balance_bias: this layer was built with "
                             "balance_bias=False")
        where = "MoE.update_balance_bias"
        counts = _real_array(where, "tokens_per_expert", tokens_per_expert, "real counts")
        if counts.shape != (self.num_experts,):
            raise ValueError("MoE.update_balance_bias: tokens_per_expert must have shape "
                             f"[E] = ({self.num_experts},), got {counts.shape}")
        rate_in = rate
        rate = _real_array(where, "rate", rate, "a real number")
        if rate.shape not in ((), (self.num_experts,)):
            raise ValueError("MoE.update_balance_bias: rate must be a scalar or have shape "
                             f"[E] = ({self.num_experts},), got {rate.shape}")
        # A traced rate cannot be checked (nor an array some devices cannot read).
        if not isinstance(rate, jax.core.Tracer) and rate.is_fully_addressable:
            concrete = np.asarray(rate, np.float64)
            if not np.all(np.isfinite(concrete) & (concrete >= 0)):
                raise ValueError("MoE.update_balance_bias: rate must be finite and >= 0 "
                                 f"(a negative rate unbalances the experts), got {rate_in!r}")
        counts, rate = counts.astype(jnp.float32), rate.astype(jnp.float32)
        step = rate * jnp.sign(jnp.mean(counts) - counts)
        self.balance_bias[...] = self.balance_bias[...] + step


def moe_layers(model: nnx.Module) -> list[tuple[tuple, MoE]]:
    """Every `MoE` in ``model`` as ``(path, layer)``, in graph order."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, MoE)]
