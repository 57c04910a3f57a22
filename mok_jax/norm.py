"""Residual add fused with RMSNorm: ``s = x + branch; n = rmsnorm(s) * scale``.

A pre-norm transformer adds each block's branch to the residual stream and
normalises the sum for the next branch. XLA runs that as three passes over the
rows each way (the add, the row reduction, the broadcast that uses it; the
backward reads the normalised input and its cotangent twice more for the scale's
gradient). On a GPU `add_rms_norm` is one CUDA kernel each way: the forward
reads x and branch and writes s and n; the backward reads n's and s's
cotangents and s, and writes the one gradient x and branch share. The scale's
gradient is summed in fixed groups of rows, then over the groups: the same bits
on every run. On the CPU, and for rows the kernels do not take, the same
primitives lower to the same math in jnp: the op is one custom VJP at every row
width, with the same autodiff (first order, reverse mode) and the same sharding
rule.

Numerics (f32 arithmetic, T = x.dtype, as ``flax.nnx.RMSNorm`` computes them):
``s = round_T(x + branch)``, ``rstd = 1 / sqrt(mean(s^2) + epsilon)``,
``n = round_T(s * (rstd * scale))``. Under ``jax.jit`` on arrays sharded over
a mesh the rows stay where they are (a ``custom_partitioning`` rule); the
scale's gradient is summed over the mesh axes that split the rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from mok_jax._src import ext, primitives, sharding
from mok_jax._src.primitives import Array, Signature

FORWARD = "mok_add_rms_norm_fwd"
BACKWARD = "mok_add_rms_norm_bwd"

# Rows per partial sum of the scale's gradient in the CUDA backward (kernels/rms_norm.h).
ROWS_PER_GROUP = 16
# Widest bf16 row the CUDA kernels take (half that in f32); rows must be a multiple of 8.
MAX_DIM = 16384


def kernel_takes(dtype, dim: int) -> bool:
    """Whether the CUDA kernels take rows of `dim` elements of `dtype`."""
    limit = MAX_DIM if jnp.dtype(dtype) == jnp.bfloat16 else MAX_DIM // 2
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32) and 0 < dim <= limit and dim % 8 == 0


# --- the math in jnp (the CPU lowering, and rows the kernels do not take) -------------

def _forward_math(x, branch, scale, *, epsilon):
    # n is the norm of the rounded s: the rounding as a reduce_precision in f32, which
    # XLA keeps, where it may fold a bf16 add's f32 -> bf16 -> f32 round trip into
    # the identity (excess precision) and normalise the unrounded sum.
    sf = x.astype(jnp.float32) + branch.astype(jnp.float32)
    if x.dtype != jnp.float32:
        info = jnp.finfo(x.dtype)
        sf = jax.lax.reduce_precision(sf, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    s = sf.astype(x.dtype)
    rstd = jax.lax.rsqrt(jnp.mean(sf * sf, axis=-1) + epsilon)
    n = (sf * (rstd[..., None] * scale)).astype(x.dtype)
    return s, n, rstd


def _backward_math(dn, ds, s, rstd, scale):
    sf = s.astype(jnp.float32)
    r = rstd[..., None]
    g = dn.astype(jnp.float32) * scale
    c = r * r * r * jnp.sum(g * sf, axis=-1, keepdims=True) / s.shape[-1]
    d = (ds.astype(jnp.float32) + r * g - sf * c).astype(s.dtype)
    dscale = jnp.sum(dn.astype(jnp.float32) * sf * r, axis=tuple(range(s.ndim - 1)))
    return d, dscale


# --- primitives on [R, D] rows ------------------------------------------------------
#
# Factors: r rows, d the normalised dim.

FORWARD_SIGNATURE = Signature(
    (Array("x", "r d", "x"), Array("branch", "r d", "x"), Array("scale", "d", "float32")),
    (Array("s", "r d", "x", like="x"), Array("n", "r d", "x", like="x"),
     Array("rstd", "r", "float32")))
BACKWARD_SIGNATURE = Signature(
    (Array("dn", "r d", "s"), Array("ds", "r d", "s"), Array("s", "r d", "s"),
     Array("rstd", "r", "float32"), Array("scale", "d", "float32")),
    (Array("d", "r d", "s", like="s"), Array("dscale", "d", "float32")))


def _kernel_lowers(target: str, rows_aval) -> bool:
    """Whether a CUDA lowering calls `target`: the build has its handler and the
    kernels take rows of this width (else the lowering is the jnp form, behind the
    same primitive, custom VJP and partitioning at every width)."""
    return (target in ext.registered_targets().get("cuda", ())
            and kernel_takes(rows_aval.dtype, rows_aval.shape[-1]))


def _cuda_forward(ctx, x, branch, scale, *, epsilon):
    if not _kernel_lowers(FORWARD, ctx.avals_in[0]):
        return _jnp_forward(ctx, x, branch, scale, epsilon=epsilon)
    return jax.ffi.ffi_lowering(FORWARD)(ctx, x, branch, scale, epsilon=np.float32(epsilon))


def _cuda_backward(ctx, dn, ds, s, rstd, scale):
    if not _kernel_lowers(BACKWARD, ctx.avals_in[2]):
        return _jnp_backward(ctx, dn, ds, s, rstd, scale)

    def call(dn, ds, s, rstd, scale):
        rows, dim = s.shape
        groups = -(-rows // ROWS_PER_GROUP)
        d, partials = jax.ffi.ffi_call(
            BACKWARD, (jax.ShapeDtypeStruct(s.shape, s.dtype),
                       jax.ShapeDtypeStruct((groups, dim), jnp.float32)))(dn, ds, s, rstd, scale)
        return d, jnp.sum(partials, axis=0)

    return mlir.lower_fun(call, multiple_results=True)(ctx, dn, ds, s, rstd, scale)


_jnp_forward = mlir.lower_fun(_forward_math, multiple_results=True)
_jnp_backward = mlir.lower_fun(_backward_math, multiple_results=True)

fwd_p = primitives.define(FORWARD, FORWARD_SIGNATURE,
                          lowerings={"cuda": _cuda_forward, "cpu": _jnp_forward})
bwd_p = primitives.define(BACKWARD, BACKWARD_SIGNATURE,
                          lowerings={"cuda": _cuda_backward, "cpu": _jnp_backward})


# --- partitioning: rows stay where they are --------------------------------------------

def _row_axes(mesh, arg_shape) -> tuple[str, ...]:
    """The mesh axes splitting the rows of `arg_shape` when they split them evenly
    (else none: the rows are gathered, which is correct, only slower)."""
    spec = arg_shape.sharding.spec if isinstance(arg_shape.sharding, NamedSharding) else ()
    axes = sharding.mesh_axes(spec, 0)
    size = 1
    for a in axes:
        size *= mesh.shape[a]
    return axes if axes and arg_shape.shape[0] % size == 0 else ()


def _row_split(mesh, arg_shape) -> dict:
    """How the signatures' factors are split: rows ("r") as `_row_axes` says."""
    return {"r": _row_axes(mesh, arg_shape) or None}


def _bind_forward(x, branch, scale, epsilon):
    return tuple(fwd_p.bind(x, branch, scale, epsilon=epsilon))


def _bind_backward(dn, ds, s, rstd, scale):
    return tuple(bwd_p.bind(dn, ds, s, rstd, scale))


_forward_cp = custom_partitioning(_bind_forward, static_argnums=(3,))


def _forward_infer(epsilon, mesh, arg_shapes, result_shape):
    del epsilon, result_shape
    split = _row_split(mesh, arg_shapes[0])
    return FORWARD_SIGNATURE.shardings(mesh, split)[1]


def _forward_partition(epsilon, mesh, arg_shapes, result_shape):
    del result_shape
    split = _row_split(mesh, arg_shapes[0])
    operand_shardings, result_shardings = FORWARD_SIGNATURE.shardings(mesh, split)
    lower_fn = functools.partial(_bind_forward, epsilon=epsilon)
    return mesh, sharding.per_device(lower_fn), result_shardings, operand_shardings


_forward_cp.def_partition(
    partition=_forward_partition, infer_sharding_from_operands=_forward_infer,
    sharding_rule=FORWARD_SIGNATURE.rule(),
    need_replication_factors=FORWARD_SIGNATURE.replicated_factors(("r",)))


_backward_cp = custom_partitioning(_bind_backward)


def _backward_infer(mesh, arg_shapes, result_shape):
    del result_shape
    split = _row_split(mesh, arg_shapes[2])
    return BACKWARD_SIGNATURE.shardings(mesh, split)[1]


def _backward_partition(mesh, arg_shapes, result_shape):
    del result_shape
    split = _row_split(mesh, arg_shapes[2])
    axes = split["r"]
    operand_shardings, result_shardings = BACKWARD_SIGNATURE.shardings(mesh, split)

    def lower_fn(dn, ds, s, rstd, scale):
        d, dscale = _bind_backward(dn, ds, s, rstd, scale)
        return d, (jax.lax.psum(dscale, axes) if axes else dscale)

    return mesh, sharding.per_device(lower_fn), result_shardings, operand_shardings


_backward_cp.def_partition(
    partition=_backward_partition, infer_sharding_from_operands=_backward_infer,
    sharding_rule=BACKWARD_SIGNATURE.rule(),
    need_replication_factors=BACKWARD_SIGNATURE.replicated_factors(("r",)))


# The custom VJP's forward and backward come in two forms: "rows", the primitives on
# [R, D] rows (partitioned by rows on a mesh; the kernels or the jnp form, as the
# lowering finds the width), and "jnp", the same math in jnp on x's own shape, for
# arrays the rows cannot be made of (see add_rms_norm). Both are first order only.

SECOND_ORDER = (
    "mok_jax.add_rms_norm has no second-order derivatives (jax.grad of jax.grad, "
    "jax.hessian, jax.jvp of a gradient): it is a custom VJP whose forward and "
    "backward have no derivative rules. Differentiate it once, in reverse mode, or "
    "use nnx.RMSNorm on x + branch")


def _typed_like(a, like):
    """`a` with `like`'s type where Explicit mesh axes make them differ."""
    if sharding.explicit_spec(a) == sharding.explicit_spec(like):
        return a
    like_sharding = jax.typeof(like).sharding  # on no mesh where like is unsplit
    mesh = jax.typeof(a).sharding.mesh if like_sharding.mesh.empty else like_sharding.mesh
    return jax.sharding.reshard(a, NamedSharding(mesh, like_sharding.spec))


def _forward_impl(x, branch, scale, epsilon, form):
    if form == "jnp":
        return _forward_math(x, branch, scale, epsilon=epsilon)
    if sharding.on_a_mesh((x, branch, scale)):
        return sharding.unless_vmapped(_forward_cp, _bind_forward, (x, branch, scale),
                                       (epsilon,))
    return _bind_forward(x, branch, scale, epsilon)


def _backward_impl(dn, ds, s, rstd, scale, form):
    if form == "jnp":
        d, dscale = _backward_math(dn, ds, s, rstd, scale)
        # The gradients of the primals' types (n may be split like the scale).
        return _typed_like(d, s), _typed_like(dscale, scale)
    if sharding.on_a_mesh((dn, ds, s, rstd, scale)):
        return sharding.unless_vmapped(_backward_cp, _bind_backward, (dn, ds, s, rstd, scale))
    return _bind_backward(dn, ds, s, rstd, scale)


_forward = primitives.first_order_only(_forward_impl, SECOND_ORDER, nondiff_argnums=(3, 4))
_backward = primitives.first_order_only(_backward_impl, SECOND_ORDER, nondiff_argnums=(5,))


# --- the differentiable op -----------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _add_rms_norm(x, branch, scale, epsilon, form):
    s, n, _ = _forward(x, branch, scale, epsilon, form)
    return s, n


def _add_rms_norm_fwd(x, branch, scale, epsilon, form):
    s, n, rstd = _forward(x, branch, scale, epsilon, form)
    return (s, n), (s, rstd, scale)


def _add_rms_norm_bwd(epsilon, form, residuals, cotangents):
    del epsilon
    s, rstd, scale = residuals
    ds, dn = cotangents
    d, dscale = _backward(dn.astype(s.dtype), ds.astype(s.dtype), s, rstd, scale, form)
    return d, d, dscale


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)


def _finite_float(v) -> bool:
    """Whether `v` is a number a float holds finitely (an int past a float's range
    is not)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def add_rms_norm(x: jax.Array, branch: jax.Array, scale: jax.Array, *,
                 epsilon: float = 1e-6) -> tuple[jax.Array, jax.Array]:
    """``(s, n)``: the residual sum ``s = x + branch`` and ``n = rmsnorm(s) * scale``,
    normalised over the last axis, in one pass each way on a GPU.

    Args:
      x, branch: ``[..., D]`` float32 or bfloat16, the same shape and dtype.
      scale: ``[D]``, the norm's learned scale (e.g. ``flax.nnx.RMSNorm``'s, float32);
        computed in float32, its gradient returned in its own dtype.
      epsilon: added to the mean square (``flax.nnx.RMSNorm``'s default, 1e-6); a
        Python number, static under ``jax.jit``.

    ``s`` and ``n`` have x's dtype; the values are those of ``nnx.RMSNorm(...)(x +
    branch)`` with this scale and epsilon, up to the order of the f32 sums (a bf16 ``n``
    differs in at most the last bit, rarely). Rows of more than 16384 elements (8192 in
    float32) or not a multiple of 8 lower to the same math in jnp, behind the same
    primitives; arrays whose Explicit sharding splits a dim other than the first and
    the last, a scale whose Explicit sharding splits it, and empty arrays take the
    jnp form on x's own shape. Under Explicit mesh axes ``s`` and ``n`` have x's type
    (branch is resharded to it; a scale split by its type splits n's last dim the
    same way), and each gradient its primal's.

    Whatever the width and the form: a custom VJP, differentiable once in reverse
    mode (``jax.grad``, ``jax.vjp``); ``jax.jvp`` raises ``TypeError`` and every
    second-order derivative (``jax.grad`` of ``jax.grad``, ``jax.hessian``,
    ``jax.jvp`` of a gradient) raises ``NotImplementedError`` (`SECOND_ORDER`), as
    for ``mok_jax.moe``. Under ``vmap`` the rows' form makes one call per example.
    """
    x, branch, scale = (jnp.asarray(a) for a in (x, branch, scale))
    if (isinstance(epsilon, (bool, np.bool_))
            or not isinstance(epsilon, (int, float, np.integer, np.floating))
            or not _finite_float(epsilon) or epsilon < 0):
        raise ValueError("add_rms_norm: epsilon must be a non-negative finite Python number "
                         f"(static, as nnx.RMSNorm's), got {epsilon!r}")
    epsilon = float(epsilon)
    if x.shape != branch.shape or x.dtype != branch.dtype:
        raise ValueError(
            f"add_rms_norm: x {x.dtype}{list(x.shape)} and branch {branch.dtype}"
            f"{list(branch.shape)} must have the same shape and dtype")
    if x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"add_rms_norm: x must be float32 or bfloat16, got {x.dtype}")
    if x.ndim < 1:
        raise ValueError("add_rms_norm: x must have at least one axis (the normalised one)")
    if scale.shape != x.shape[-1:]:
        raise ValueError(
            f"add_rms_norm: scale has shape {list(scale.shape)}, expected {list(x.shape[-1:])} "
            f"(the last axis of x {list(x.shape)})")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
        raise ValueError(f"add_rms_norm: scale must be floating point, got {scale.dtype}")
    branch_mesh = jax.typeof(branch).sharding.mesh
    if not branch_mesh.empty and sharding.explicit_spec(branch) != sharding.explicit_spec(x):
        # s and n have x's type, whatever branch's: branch takes x's type first (the
        # reshard's transpose gives its gradient its own), as the custom VJP returns
        # one gradient for x and branch.
        x_sharding = jax.typeof(x).sharding
        branch = jax.sharding.reshard(branch, x_sharding if x_sharding.mesh == branch_mesh
                                      else NamedSharding(branch_mesh, PartitionSpec()))
    # The primitives take the rows as one [R, D] array, at every width (their
    # lowering picks the kernels or the jnp form). A type that splits a dim between
    # the first and the last (Explicit axes, e.g. sequence parallelism) does not say
    # how merging the leading dims would be split, and the backward returns the
    # scale's gradient whole (its type must be the scale's): the jnp form on x's
    # own shape for those, for a scale whose type splits it, and for empty arrays,
    # behind the same custom VJP.
    inner_split = any(axes for axes in sharding.explicit_spec(x)[1:-1])
    scale_split = any(sharding.explicit_spec(scale))
    x, branch, scale32 = primitives.vary_alike((x, branch, scale.astype(jnp.float32)))
    if inner_split or scale_split or x.size == 0:
        return _add_rms_norm(x, branch, scale32, epsilon, "jnp")
    rows = x.reshape(-1, x.shape[-1])
    s, n = _add_rms_norm(rows, branch.reshape(rows.shape), scale32, epsilon, "rows")
    return s.reshape(x.shape), n.reshape(x.shape)
