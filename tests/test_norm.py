"""mok_jax.add_rms_norm: the residual add fused with RMSNorm.

On the CPU the op is the jnp form of its math behind the same custom VJP and
partitioning rule as on a GPU; these tests hold it against autodiff of
``nnx.RMSNorm`` on ``x + branch`` and check its partitioning on host devices.
The GPU tests compare the CUDA kernels with the jnp form and with themselves.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax
from mok_jax import norm

from conftest import assert_bitwise

CPUS = jax.devices("cpu")  # the mesh tests run on host devices, whatever the default


def _operands(shape, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], shape, jnp.float32).astype(dtype)
    branch = (0.5 * jax.random.normal(ks[1], shape, jnp.float32)).astype(dtype)
    scale = 1.0 + 0.2 * jax.random.normal(ks[2], shape[-1:], jnp.float32)
    dn = jax.random.normal(ks[3], shape, jnp.float32).astype(dtype)
    ds = jax.random.normal(ks[4], shape, jnp.float32).astype(dtype)
    return x, branch, scale, dn, ds


def _nnx_form(x, branch, scale, epsilon=1e-6):
    """What the op replaces: the add, then nnx.RMSNorm with this scale (cast to the
    norm's dtype, as nnx promotes it)."""
    layer = nnx.RMSNorm(x.shape[-1], dtype=x.dtype, epsilon=epsilon, rngs=nnx.Rngs(0))
    layer.scale.set_value(scale)
    s = x + branch
    return s, layer(s)


def _vjp(fn, x, branch, scale, dn, ds):
    (s, n), pullback = jax.vjp(fn, x, branch, scale)
    return (s, n), pullback((ds, dn))


def _close(a, b, rtol, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4, 6, 64), (5, 24), (3, 20)])  # (3, 20): not a multiple of 8
def test_values_and_gradients_match_nnx_rmsnorm(dtype, shape):
    """s is x + branch bit for bit; n, and the gradients of x, branch and the scale,
    match autodiff of ``nnx.RMSNorm(x + branch)`` (the scale in the norm's dtype)."""
    x, branch, scale, dn, ds = _operands(shape, dtype)

    def op(x, branch, scale):  # the scale in x's dtype, as the example passes it
        return mok_jax.add_rms_norm(x, branch, scale.astype(dtype))

    def ref(x, branch, scale):
        return _nnx_form(x, branch, scale)

    (s, n), (dx, db, dscale) = jax.jit(functools.partial(_vjp, op))(x, branch, scale, dn, ds)
    (s_ref, n_ref), (dx_ref, db_ref, dscale_ref) = jax.jit(functools.partial(_vjp, ref))(
        x, branch, scale, dn, ds)
    assert s.dtype == n.dtype == dx.dtype == dtype and dscale.dtype == scale.dtype
    assert_bitwise(s, s_ref, "s")
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    _close(n, n_ref, tol, "n")
    _close(dx, dx_ref, tol, "dx")
    assert_bitwise(dx, db, "dx and dbranch")  # one gradient for both
    _close(dscale, dscale_ref, 1e-5 if dtype == jnp.float32 else 1e-2, "dscale")


@pytest.mark.parametrize("dim", [16, 12])  # the kernels' width on a GPU, and the jnp form's
def test_n_is_the_norm_of_the_rounded_sum(dim):
    """n normalises the s the op returns (rounded to bf16), not the f32 sum before
    the rounding, eagerly and under jit: the op on (s, 0) gives n's bits again."""
    x, branch, scale, _, _ = _operands((64, dim), jnp.bfloat16)
    for fn in (mok_jax.add_rms_norm, jax.jit(mok_jax.add_rms_norm)):
        s, n = fn(x, branch, scale)
        assert_bitwise(fn(s, jnp.zeros_like(s), scale)[1], n, "n of s")
        assert_bitwise(jax.jit(mok_jax.add_rms_norm)(x, branch, scale)[1], n, "jit")


def test_bad_operands_raise():
    x = jnp.ones((4, 16), jnp.float32)
    scale = jnp.ones((16,), jnp.float32)
    with pytest.raises(ValueError, match="same shape and dtype"):
        mok_jax.add_rms_norm(x, jnp.ones((4, 8), jnp.float32), scale)
    with pytest.raises(ValueError, match="same shape and dtype"):
        mok_jax.add_rms_norm(x, x.astype(jnp.bfloat16), scale)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        mok_jax.add_rms_norm(x.astype(jnp.float16), x.astype(jnp.float16), scale)
    with pytest.raises(ValueError, match=r"scale has shape \[8\], expected \[16\]"):
        mok_jax.add_rms_norm(x, x, jnp.ones((8,), jnp.float32))
    with pytest.raises(ValueError, match="floating point"):
        mok_jax.add_rms_norm(x, x, jnp.ones((16,), jnp.int32))
    with pytest.raises(ValueError, match="at least one axis"):
        mok_jax.add_rms_norm(x[0, 0], x[0, 0], jnp.ones((), jnp.float32))
    for eps in ("0.5", -1e-6, float("nan"), True, jnp.float32(1e-6), 10**400):
        with pytest.raises(ValueError, match="epsilon must be a non-negative finite"):
            mok_jax.add_rms_norm(x, x, scale, epsilon=eps)
    # A traced epsilon gets the same message, whichever form the row width takes.
    for width in (16, 12):
        xs, sc = jnp.ones((4, width), jnp.float32), jnp.ones((width,), jnp.float32)
        with pytest.raises(ValueError, match="epsilon must be a non-negative finite"):
            jax.jit(lambda e: mok_jax.add_rms_norm(xs, xs, sc, epsilon=e))(1e-6)


def test_kernel_takes():
    """The rows the CUDA kernels take: a multiple of 8, at most 16384 bf16 / 8192 f32."""
    assert norm.kernel_takes(jnp.bfloat16, 16384) and not norm.kernel_takes(jnp.bfloat16, 16392)
    assert norm.kernel_takes(jnp.float32, 8192) and not norm.kernel_takes(jnp.float32, 8200)
    assert not norm.kernel_takes(jnp.bfloat16, 20) and norm.kernel_takes(jnp.bfloat16, 8)


# Widths on both sides of `norm.kernel_takes`: rows the CUDA kernels take (a multiple
# of 8, at most 8192 f32 / 16384 bf16) and rows they do not.
WIDTHS = [(jnp.float32, 16), (jnp.float32, 12), (jnp.float32, 8192), (jnp.float32, 8200),
          (jnp.bfloat16, 8), (jnp.bfloat16, 20), (jnp.bfloat16, 16384),
          (jnp.bfloat16, 16392)]
SECOND_ORDER = "add_rms_norm has no second-order derivatives"


def _loss(x, branch, scale):
    s, n = mok_jax.add_rms_norm(x, branch, scale)
    return jnp.sum(s.astype(jnp.float32) ** 2) + jnp.sum(n.astype(jnp.float32) ** 2)


def _second_orders(x, branch, scale):
    """Second-order derivatives of the loss w.r.t. x, traced only (make_jaxpr)."""
    grad = jax.grad(_loss)
    return {
        "grad of grad": lambda: jax.make_jaxpr(
            jax.grad(lambda x: jnp.sum(grad(x, branch, scale).astype(jnp.float32))))(x),
        "hessian": lambda: jax.make_jaxpr(jax.hessian(_loss))(x, branch, scale),
        "jvp of the gradient": lambda: jax.make_jaxpr(
            lambda x: jax.jvp(lambda x: grad(x, branch, scale), (x,), (x,)))(x),
        "grad of grad w.r.t. the scale": lambda: jax.make_jaxpr(jax.grad(
            lambda sc: jnp.sum(jax.grad(_loss, argnums=2)(x, branch, sc))))(scale),
    }


def _assert_first_order_only(x, branch, scale):
    """Forward mode raises TypeError and every second-order form the one
    NotImplementedError."""
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda x: _loss(x, branch, scale), (x,), (x,))
    for what, trace in _second_orders(x, branch, scale).items():
        with pytest.raises(NotImplementedError, match=SECOND_ORDER):
            trace()
            pytest.fail(f"{what} did not raise")


@pytest.mark.parametrize("dtype, dim", WIDTHS)
def test_autodiff_does_not_depend_on_the_width(dtype, dim):
    """At every width the op is the same custom VJP: first order works, forward mode
    raises TypeError, and every second-order derivative raises the one
    NotImplementedError (as `moe`'s does), whether the kernels take the rows or not."""
    x, branch, scale, _, _ = _operands((2, dim), dtype, seed=dim)
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1, 2)))(x, branch, scale))
    assert norm.FORWARD in jaxpr and norm.BACKWARD in jaxpr, "not the primitives"
    _assert_first_order_only(x, branch, scale)


@pytest.mark.parametrize("case", ["auto mesh", "explicit mesh", "inner dim split",
                                  "scale split", "no rows", "empty rows"])
@pytest.mark.parametrize("dim", [16, 12])
def test_second_order_raises_the_same_error_for_every_form(case, dim):
    """The partitioned rows (Auto and Explicit axes) and the jnp form on x's own shape
    (an inner dim or the scale split by an Explicit axis, empty arrays) are the same
    custom VJP: the same errors as one device, at every width."""
    shape = {"no rows": (0, dim), "empty rows": (2, 0, dim)}.get(case, (4, 4, dim))
    x, branch, scale, _, _ = jax.device_put(_operands(shape, jnp.float32, seed=dim), CPUS[0])
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4], axis_types=(
        (jax.sharding.AxisType.Auto,) * 2 if case == "auto mesh"
        else (jax.sharding.AxisType.Explicit,) * 2))
    rows, scale_spec = {"inner dim split": (P(None, "a"), P()),
                        "scale split": (P("a"), P("b"))}.get(
                            case, (P("a"), P()))
    with jax.set_mesh(mesh):
        x, branch = (jax.device_put(a, NamedSharding(mesh, rows)) for a in (x, branch))
        scale = jax.device_put(scale, NamedSharding(mesh, scale_spec))
        jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1, 2)))(x, branch, scale)
        _assert_first_order_only(x, branch, scale)


@pytest.mark.parametrize("x_spec, branch_spec", [
    (P("a"), P()), (P(), P("a")), (P("a"), P("b")), (P("a"), P("a", "b")),
    (P(None, "a"), P("a")),  # a split inner dim: the jnp form
])
def test_output_types_do_not_depend_on_the_width(x_spec, branch_spec):
    """Explicit axes: s and n have x's type at every width, whatever branch's type (the
    one rule of the custom VJP, whose gradient of x and branch is one array); each
    gradient has its primal's type; values equal the unsharded call's."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4])  # Explicit axes
    shape_of = (lambda d: (4, 4, d)) if len(x_spec) > 1 and x_spec[1] else (lambda d: (8, d))
    types = set()
    for dtype, dim in WIDTHS[:4]:
        x, branch, scale, _, _ = jax.device_put(_operands(shape_of(dim), dtype, seed=dim),
                                                CPUS[0])
        want = jax.jit(mok_jax.add_rms_norm)(x, branch, scale)
        want_grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(x, branch, scale)
        with jax.set_mesh(mesh):
            args = (jax.device_put(x, NamedSharding(mesh, x_spec)),
                    jax.device_put(branch, NamedSharding(mesh, branch_spec)),
                    jax.device_put(scale, NamedSharding(mesh, P())))
            s, n = jax.jit(mok_jax.add_rms_norm)(*args)
            grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(*args)
        x_type = jax.typeof(args[0]).sharding.spec
        assert jax.typeof(s).sharding.spec == x_type, (dim, "s", jax.typeof(s).sharding.spec)
        assert jax.typeof(n).sharding.spec == x_type, (dim, "n", jax.typeof(n).sharding.spec)
        types.add((jax.typeof(s).sharding.spec, jax.typeof(n).sharding.spec))
        for g, a, what in zip(grads, args, ("dx", "dbranch", "dscale")):
            assert jax.typeof(g).sharding.spec == jax.typeof(a).sharding.spec, (dim, what)
        assert_bitwise(s, want[0], f"s at width {dim}")
        _close(n, want[1], 1e-6, f"n at width {dim}")
        for g, w, what in zip(grads, want_grads, ("dx", "dbranch", "dscale")):
            _close(g, w, 1e-5, f"{what} at width {dim}")
    assert len(types) == 1, types


@pytest.mark.parametrize("x_spec, branch_spec, scale_spec", [
    (P(None, "a", "b"), P(), None), (P(None, "a", "b"), P(), P()),
    (P(None, "a"), P(None, "a"), P("b")), (P("a", None, "b"), P(), P("b")),
])
def test_the_jnp_form_gives_the_gradients_of_autodiff(x_spec, branch_spec, scale_spec):
    """The jnp form behind the custom VJP (an inner dim or the scale split by an
    Explicit axis): under jit, the gradients of autodiff of the unsharded call, each
    of its primal's type, whether the scale is split, replicated or on no mesh."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4])  # Explicit axes
    x, branch, scale, _, _ = jax.device_put(_operands((4, 4, 16), jnp.float32, seed=12),
                                            CPUS[0])
    grad = jax.grad(_loss, argnums=(0, 1, 2))
    want = jax.jit(grad)(x, branch, scale)
    unplaced = jnp.asarray(np.asarray(scale))  # made outside the mesh: on no mesh
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, NamedSharding(mesh, x_spec)),
                jax.device_put(branch, NamedSharding(mesh, branch_spec)),
                unplaced if scale_spec is None
                else jax.device_put(scale, NamedSharding(mesh, scale_spec)))
        got = jax.jit(grad)(*args)
        assert norm.FORWARD not in str(jax.make_jaxpr(grad)(*args))
    for g, a, w, what in zip(got, args, want, ("dx", "dbranch", "dscale")):
        assert jax.typeof(g).sharding.spec == (
            jax.typeof(a).sharding.spec if what != "dscale" or scale_spec else P(None)), what
        _close(g, w, 1e-5, what)


@pytest.mark.parametrize("dtype, dim", WIDTHS)
def test_the_cuda_lowering_calls_the_kernels_where_they_take_the_width(dtype, dim,
                                                                       monkeypatch):
    """Lowered for CUDA (on any machine, with the handlers taken as registered): the
    same primitives at every width, which call the kernels exactly where
    `kernel_takes` says and lower to the jnp form elsewhere."""
    targets = {"cuda": frozenset({norm.FORWARD, norm.BACKWARD})}
    monkeypatch.setattr(norm.ext, "registered_targets", lambda: targets)
    x, branch, scale, _, _ = _operands((4, dim), dtype, seed=dim)
    step = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))
    traced = step.trace(x, branch, scale)
    assert norm.FORWARD in str(traced.jaxpr) and norm.BACKWARD in str(traced.jaxpr)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = set(re.findall(r"custom_call @(mok_add_rms_norm_\w+)", text))
    want = {norm.FORWARD, norm.BACKWARD} if norm.kernel_takes(dtype, dim) else set()
    assert calls == want, (dim, calls)


@pytest.mark.parametrize("dim", [32, 20])  # rows the kernels take, and rows they do not
@pytest.mark.parametrize("spec", [P("a"), P(("a", "b")), P("b")])
def test_partitioned_rows_stay_on_their_devices(spec, dim):
    """Under jit on rows sharded over a mesh, at every width: the results equal the
    one-device call (s exactly, the rest up to the order of XLA's CPU sums), the rows
    are never gathered (no all-gather in the compiled step), and the scale's gradient
    is summed over the axes that split the rows (an all-reduce)."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, branch, scale, dn, ds = jax.device_put(_operands((8, 16, dim), jnp.float32, seed=3),
                                              CPUS[0])

    def step(x, branch, scale, dn, ds):
        return _vjp(mok_jax.add_rms_norm, x, branch, scale, dn, ds)

    want = jax.jit(step)(x, branch, scale, dn, ds)
    rows = NamedSharding(mesh, spec)
    with jax.set_mesh(mesh):
        sharded = [jax.device_put(a, rows) for a in (x, branch)] + [
            jax.device_put(scale, NamedSharding(mesh, P()))] + [
            jax.device_put(a, rows) for a in (dn, ds)]
        compiled = jax.jit(step).lower(*sharded).compile()
        got = compiled(*sharded)
    assert "CustomSPMDPartitioning" in jax.jit(step).lower(*sharded).as_text()  # our rule
    text = compiled.as_text()
    assert "all-gather" not in text, "the rows were gathered"
    assert "all-reduce" in text, "the scale's gradient was not summed over the devices"
    (s, n), (dx, db, dscale) = got
    (s_w, n_w), (dx_w, db_w, dscale_w) = want
    for a, b, what in ((s, s_w, "s"), (n, n_w, "n"), (dx, dx_w, "dx"), (db, db_w, "dbranch")):
        assert a.sharding.spec[0] == spec[0], what
        _close(a, b, 0.0 if what == "s" else 1e-6, what)  # XLA's CPU code sums per shape
    _close(dscale, dscale_w, 1e-6, "dscale")


def test_explicit_sharding_of_an_inner_dim_takes_the_jnp_form():
    """[B, S, D] with S split over an Explicit axis (sequence parallelism): the rows
    cannot be merged into one typed [B*S, D] array, so the op computes the jnp form,
    partitioned by XLA; values and gradients equal the unsharded call's."""
    mesh = jax.make_mesh((2,), ("a",), devices=CPUS[:2])  # Explicit axes
    x, branch, scale, dn, ds = jax.device_put(_operands((4, 4, 32), jnp.float32, seed=6),
                                              CPUS[0])

    def step(x, branch, scale, dn, ds):
        return _vjp(mok_jax.add_rms_norm, x, branch, scale, dn, ds)

    want = jax.jit(step)(x, branch, scale, dn, ds)
    inner = NamedSharding(mesh, P(None, "a"))
    with jax.set_mesh(mesh):
        args = [jax.device_put(a, inner) for a in (x, branch)] + [
            jax.device_put(scale, NamedSharding(mesh, P()))] + [
            jax.device_put(a, inner) for a in (dn, ds)]
        assert norm.FORWARD not in str(jax.make_jaxpr(step)(*args))
        got = jax.jit(step)(*args)
    for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                          ("s", "n", "dx", "dbranch", "dscale")):
        _close(a, b, 1e-6, what)


def test_a_scale_split_by_an_explicit_axis_takes_the_jnp_form():
    """A scale whose type splits it (an Explicit axis over D): its gradient must
    come back with that type, which the kernels' whole-scale gradient does not
    have, so the op computes the jnp form; values and gradients equal the
    unsharded call's, whether the rows are split or not."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4])  # Explicit axes
    x, branch, scale, dn, ds = jax.device_put(_operands((8, 32), jnp.float32, seed=9),
                                              CPUS[0])
    want = jax.jit(functools.partial(_vjp, mok_jax.add_rms_norm))(x, branch, scale, dn, ds)

    def step(x, branch, scale, dn, ds):
        (s, n), pullback = jax.vjp(mok_jax.add_rms_norm, x, branch, scale)
        # Each cotangent of the type of its output (n's is split like the scale).
        like = lambda c, o: jax.sharding.reshard(c, jax.typeof(o).sharding.spec)  # noqa: E731
        return (s, n), pullback((like(ds, s), like(dn, n)))

    for rows in (P(), P("a")):
        with jax.set_mesh(mesh):
            args = [jax.device_put(a, NamedSharding(mesh, rows)) for a in (x, branch)] + [
                jax.device_put(scale, NamedSharding(mesh, P("b")))] + [
                jax.device_put(a, NamedSharding(mesh, rows)) for a in (dn, ds)]
            assert norm.FORWARD not in str(jax.make_jaxpr(step)(*args))
            got = jax.jit(step)(*args)
        (_, _), (_, _, dscale) = got
        assert dscale.sharding.spec == P("b"), "the scale's gradient lost its type"
        for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                              ("s", "n", "dx", "dbranch", "dscale")):
            _close(a, b, 1e-6, what)


@pytest.mark.parametrize("x_spec, branch_spec", [(P("a"), P()), (P(), P("a")), (P("a"), P("b"))])
def test_x_and_branch_of_different_explicit_shardings(x_spec, branch_spec):
    """x and branch whose types split them differently (Explicit axes): values and
    gradients equal the unsharded call's, and each gradient has its primal's type,
    as for ``nnx.RMSNorm(x + branch)``."""
    mesh = jax.make_mesh((2, 2), ("a", "b"), devices=CPUS[:4])  # Explicit axes
    x, branch, scale, dn, ds = jax.device_put(_operands((8, 32), jnp.float32, seed=10),
                                              CPUS[0])

    def loss(x, branch, scale):
        s, n = mok_jax.add_rms_norm(x, branch, scale)
        return jnp.sum(s * ds) + jnp.sum(n * dn)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, branch, scale)
    with jax.set_mesh(mesh):
        args = (jax.device_put(x, NamedSharding(mesh, x_spec)),
                jax.device_put(branch, NamedSharding(mesh, branch_spec)),
                jax.device_put(scale, NamedSharding(mesh, P())))
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
    for g, a, what in zip(got[1], args, ("dx", "dbranch", "dscale")):
        assert jax.typeof(g).sharding.spec == jax.typeof(a).sharding.spec, what
    for a, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want),
                          ("loss", "dx", "dbranch", "dscale")):
        _close(a, b, 1e-6, what)


def test_inside_shard_map_the_scale_gradient_is_summed_over_the_batch_axis():
    """In shard_map with the scale replicated, its gradient is the sum over every
    device's rows (the op casts the scale to vary like x, and the cast's transpose
    sums), equal to the one-device gradient."""
    mesh = jax.make_mesh((4,), ("d",), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x, branch, scale, dn, ds = jax.device_put(_operands((8, 32), jnp.float32, seed=4), CPUS[0])

    def loss(x, branch, scale, dn, ds):
        s, n = mok_jax.add_rms_norm(x, branch, scale)
        return jnp.sum(s * ds) + jnp.sum(n * dn)

    want = jax.grad(loss, argnums=2)(x, branch, scale, dn, ds)

    def per_device(x, branch, scale, dn, ds):
        return jax.grad(lambda sc: jax.lax.psum(loss(x, branch, sc, dn, ds), "d"))(scale)

    specs = (P("d"), P("d"), P(), P("d"), P("d"))
    args = [jax.device_put(a, NamedSharding(mesh, p))
            for a, p in zip((x, branch, scale, dn, ds), specs)]
    got = jax.jit(jax.shard_map(per_device, mesh=mesh, out_specs=P(), in_specs=specs))(*args)
    _close(got, want, 1e-6, "dscale")


def test_vmap_is_the_per_example_call():
    x, branch, scale, _, _ = _operands((3, 4, 16), jnp.float32, seed=5)
    s, n = jax.vmap(mok_jax.add_rms_norm, in_axes=(0, 0, None))(x, branch, scale)
    for i in range(3):
        s_i, n_i = mok_jax.add_rms_norm(x[i], branch[i], scale)
        assert_bitwise(s[i], s_i, "s")
        assert_bitwise(n[i], n_i, "n")


def test_vmap_over_a_batch_sharded_over_a_mesh_axis():
    """vmap over a batch split over devices (explicit-axis sharding): each device runs
    its own examples; the per-example bits, the batch's sharding kept."""
    x, branch, scale, _, _ = _operands((4, 4, 16), jnp.float32, seed=6)
    mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        xs, bs = (jax.device_put(a, NamedSharding(mesh, P("b"))) for a in (x, branch))
        s, n = jax.jit(jax.vmap(mok_jax.add_rms_norm, in_axes=(0, 0, None)))(xs, bs, scale)
        assert jax.typeof(s).sharding.spec[0] == "b"
    s, n = np.asarray(s), np.asarray(n)
    for i in range(4):
        s_i, n_i = mok_jax.add_rms_norm(x[i], branch[i], scale)
        assert_bitwise(s[i], s_i, "s")
        assert_bitwise(n[i], n_i, "n")


@pytest.mark.parametrize("axis_type", [jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit])
def test_vmap_of_a_call_traced_on_a_mesh(axis_type):
    """A call traced on a mesh before vmap reaches it (vmap of jax.jit, and of a
    jitted gradient, under jax.set_mesh): each example's bits, values and gradients."""
    x, branch, scale, dn, ds = _operands((2, 4, 16), jnp.float32, seed=7)
    mesh = jax.make_mesh((2,), ("b",), axis_types=(axis_type,))

    def loss(x, branch, scale, dn, ds):
        s, n = mok_jax.add_rms_norm(x, branch, scale)
        return jnp.sum(s * ds) + jnp.sum(n * dn)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        s, n = jax.vmap(jax.jit(mok_jax.add_rms_norm), in_axes=(0, 0, None))(x, branch, scale)
        g = jax.vmap(jax.jit(grad), in_axes=(0, 0, None, 0, 0))(x, branch, scale, dn, ds)
    for i in range(2):
        s_i, n_i = mok_jax.add_rms_norm(x[i], branch[i], scale)
        assert_bitwise(s[i], s_i, "s")
        assert_bitwise(n[i], n_i, "n")
        for got, want, name in zip(g, grad(x[i], branch[i], scale, dn[i], ds[i]),
                                   ("dx", "dbranch", "dscale")):
            assert_bitwise(got[i], want, name)


# --- the CUDA kernels -------------------------------------------------------------------

def _math(x, branch, scale, dn, ds):
    """The jnp form, in the op's own numerics (s rounded, then normalised)."""
    s, n, rstd = norm._forward_math(x, branch, scale, epsilon=1e-6)
    d, dscale = norm._backward_math(dn, ds, s, rstd, scale)
    return s, n, rstd, d, dscale


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rows, dim", [
    (jnp.bfloat16, 4096, 1024),    # the h200 preset's rows: one warp a row
    (jnp.bfloat16, 300, 2048),     # a team of two warps
    (jnp.bfloat16, 1000, 4096),    # four warps; rows not a multiple of 16
    (jnp.bfloat16, 100, 8192),     # eight warps
    (jnp.bfloat16, 33, 16384),     # the widest bf16 row: 16 warps
    (jnp.bfloat16, 7, 8),          # one vector a row
    (jnp.float32, 513, 8192),      # the widest f32 row: 16 warps
    (jnp.float32, 50, 1024),       # f32: two warps
    (jnp.float32, 50, 4096),       # f32: eight warps
    (jnp.float32, 100, 200),       # a partial last vector set
    (jnp.bfloat16, 4_200_001, 8),  # more rows (and 16-row groups) than the grid has teams
])
def test_cuda_kernels_match_the_jnp_form_and_repeat_bit_for_bit(dtype, rows, dim):
    """Forward and backward on the GPU against the jnp form of the same math: s bit
    for bit, n and the gradient of the rows to rounding, the scale's gradient to f32
    summation order; and two calls give the same bits."""
    assert jax.devices()[0].platform == "gpu"
    x, branch, scale, dn, ds = _operands((rows, dim), dtype, seed=rows)

    @jax.jit
    def kernels(x, branch, scale, dn, ds):
        s, n, rstd = norm.fwd_p.bind(x, branch, scale, epsilon=1e-6)
        d, dscale = norm.bwd_p.bind(dn, ds, s, rstd, scale)
        return s, n, rstd, d, dscale

    text = kernels.lower(x, branch, scale, dn, ds).as_text()
    assert norm.FORWARD in text and norm.BACKWARD in text  # the FFI targets, not jnp
    got = kernels(x, branch, scale, dn, ds)
    again = kernels(x, branch, scale, dn, ds)
    for a, b, what in zip(got, again, ("s", "n", "rstd", "d", "dscale")):
        assert_bitwise(a, b, f"{what}, second call")
    want = jax.jit(_math)(x, branch, scale, dn, ds)
    assert_bitwise(got[0], want[0], "s")
    tol = 1e-6 if dtype == jnp.float32 else 8e-3
    for i, what in ((1, "n"), (2, "rstd"), (3, "d")):
        _close(got[i], want[i], tol if i != 2 else 1e-6, what)
    _close(got[4], want[4], 1e-5, "dscale")


@pytest.mark.gpu
def test_cuda_op_gradients_match_nnx_rmsnorm():
    """The public op on the GPU (the kernels behind its custom VJP) against autodiff
    of nnx.RMSNorm(x + branch), bf16 at the h200 preset's width."""
    x, branch, scale, dn, ds = _operands((2, 512, 1024), jnp.bfloat16, seed=11)

    def op(x, branch, scale):
        return mok_jax.add_rms_norm(x, branch, scale.astype(jnp.bfloat16))

    step = jax.jit(functools.partial(_vjp, op))
    assert norm.BACKWARD in step.lower(x, branch, scale, dn, ds).as_text()
    (s, n), (dx, db, dscale) = step(x, branch, scale, dn, ds)
    (s_r, n_r), (dx_r, _, dscale_r) = jax.jit(functools.partial(_vjp, _nnx_form))(
        x, branch, scale, dn, ds)
    assert_bitwise(s, s_r, "s")
    _close(n, n_r, 1e-2, "n")
    _close(dx, dx_r, 1e-2, "dx")
    assert_bitwise(dx, db, "dx and dbranch")
    _close(dscale, dscale_r, 1e-2, "dscale")
