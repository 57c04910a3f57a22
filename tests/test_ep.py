"""Expert parallelism on 8 host devices (CPU): shard_map and plain jit.

The contract (docs/contract.md): the same global batch gives the same bits for
EP size 1, 2, 4, 8, for y and every gradient; capacity and statistics are
global; under plain jit the layer partitions itself without gathering tokens
or weights.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import mok_jax

from conftest import np_stats
from ep_harness import (EP_BACKENDS, SHAPE, assert_same_bits, assert_same_results, cot,
                        gathered_types, jit_on_mesh, problem, shard_map_ep, single_device)

T, K, E, H, F = SHAPE
# These tests run on the 8 host CPU devices (conftest), also on a GPU machine;
# tests/test_ep_gpu.py runs the same checks across GPUs.
CPUS = jax.devices("cpu")


@pytest.mark.parametrize("backend", EP_BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
# EP=4 (experts and tokens split, capacity bites) stays in the fast set; the
# other sizes run with -m slow.
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.slow),
                                pytest.param(2, marks=pytest.mark.slow), 4,
                                pytest.param(8, marks=pytest.mark.slow)])
def test_shard_map_ep_is_bitwise_equal_to_one_device(ep, capacity_factor, dtype, backend):
    x, ids, w, wgu, wd = problem(dtype)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, capacity_factor)
    mesh = jax.make_mesh((ep,), ("ep",), devices=CPUS[:ep])
    y, s, g = shard_map_ep(mesh, P("ep"), x, ids, w, wgu, wd, capacity_factor,
                           backend=backend)
    assert_same_bits(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_same_bits(a, b, name)
    np.testing.assert_array_equal(s.tokens_per_expert, s1.tokens_per_expert)
    assert int(s.dropped) == int(s1.dropped)
    assert int(s.invalid) == int(s1.invalid) == 3
    if capacity_factor is not None:
        assert int(s.dropped) > 0  # the capacity really bites, globally


def test_shard_map_dp2_ep4_matches_each_data_parallel_group():
    """(dp=2, ep=4): each dp group is its own EP=4 layer over its half of the tokens;
    the replicated experts' gradients are the sum over the two groups."""
    x, ids, w, wgu, wd = problem(jnp.float32, seed=1)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=CPUS[:8])
    y, s, g = shard_map_ep(mesh, P(("dp", "ep")), x, ids, w, wgu, wd, None)
    half = T // 2
    parts = [single_device(x[i * half:(i + 1) * half], ids[i * half:(i + 1) * half],
                            w[i * half:(i + 1) * half], wgu, wd, None) for i in range(2)]
    assert_same_bits(y, jnp.concatenate([p[0] for p in parts]), "y")
    assert_same_bits(g[0], jnp.concatenate([p[2][0] for p in parts]), "dx")
    assert_same_bits(g[1], jnp.concatenate([p[2][1] for p in parts]), "d_expert_weights")
    assert_same_bits(g[2], parts[0][2][2] + parts[1][2][2], "d_w_gate_up")
    assert_same_bits(g[3], parts[0][2][3] + parts[1][2][3], "d_w_down")


@pytest.mark.parametrize("backend", EP_BACKENDS)
@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_plain_jit_on_ep_mesh_is_bitwise_equal_and_gathers_no_floats(capacity_factor, backend):
    x, ids, w, wgu, wd = problem(jnp.float32, seed=2)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, capacity_factor)
    mesh = jax.make_mesh((8,), ("ep",), devices=CPUS[:8])
    y, s, g, hlo = jit_on_mesh(mesh, P("ep"), P("ep"), x, ids, w, wgu, wd, capacity_factor,
                               backend=backend)
    assert_same_bits(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_same_bits(a, b, name)
    np.testing.assert_array_equal(s.tokens_per_expert, s1.tokens_per_expert)
    assert int(s.dropped) == int(s1.dropped)
    assert y.sharding.spec[0] == "ep"              # output stays sharded along tokens
    assert "all-to-all" in hlo                     # rows move by all_to_all ...
    gathered = gathered_types(hlo)
    assert gathered and set(gathered) <= {"s32"}, gathered  # ... only ids are gathered


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_plain_jit_inside_set_mesh_keeps_tokens_sharded_and_bits(axis_type):
    """`jax.make_mesh` gives Explicit axes; users then jit inside `jax.set_mesh`.
    y and dy must stay split like x (no all-gather of y, no slice of dy around the
    partitioned call), with the single-device bits."""
    x, ids, w, wgu, wd = problem(jnp.bfloat16, seed=7)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, 0.6)
    types = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4], axis_types=(types[axis_type],))
    with jax.set_mesh(mesh):
        y, s, g, hlo = jit_on_mesh(mesh, P("ep"), P("ep"), x, ids, w, wgu, wd, 0.6)
    assert_same_bits(y, y1, "y")
    for name, a, b in zip(("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"), g, g1):
        assert_same_bits(a, b, name)
    assert int(s.dropped) == int(s1.dropped) > 0
    assert y.sharding.spec[0] == "ep" and g[0].sharding.spec[0] == "ep"
    assert set(gathered_types(hlo)) <= {"s32"}, gathered_types(hlo)


def _mesh_typed_values(jaxpr):
    """(primitive, axis types) of every value in `jaxpr` (and its sub-jaxprs: scan
    and while bodies, scatter combiners) whose type names a mesh."""
    found = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            mesh = getattr(getattr(v.aval, "sharding", None), "mesh", None)
            if mesh is not None and not mesh.empty:
                found.append((eqn.primitive.name, mesh.axis_types))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    found += _mesh_typed_values(sub)
    return found


@pytest.mark.parametrize("which", ["forward", "forward_saving", "backward"])
def test_partitioned_code_carries_no_mesh_types_under_an_explicit_mesh(which):
    """The root cause of the one-process-per-GPU compiler abort: custom_partitioning
    traces the per-device function inside the caller's mesh context, and with
    Explicit axes every value in it was typed over the global mesh; JAX lowered
    those types to `Sharding` custom calls that XLA's GPU scatter emitter cannot
    handle. The per-device code must be free of mesh types."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    tok, wts = NamedSharding(mesh, P("ep")), NamedSharding(mesh, P("ep"))
    shapes = [jax.ShapeDtypeStruct((T, H), jnp.float32, sharding=tok),
              jax.ShapeDtypeStruct((T, K), jnp.int32, sharding=tok),
              jax.ShapeDtypeStruct((T, K), jnp.float32, sharding=tok),
              jax.ShapeDtypeStruct((E, H, 2 * F), jnp.float32, sharding=wts),
              jax.ShapeDtypeStruct((E, F, H), jnp.float32, sharding=wts)]
    bound = 4  # the EP axis size: residual rows per token = bound * K
    res = NamedSharding(mesh, P("ep", None, None))
    if which == "backward":
        shapes += [jax.ShapeDtypeStruct((T, H), jnp.float32, sharding=tok),
                   jax.ShapeDtypeStruct((T, bound * K, H), jnp.float32, sharding=res),
                   jax.ShapeDtypeStruct((T, bound * K, 2 * F), jnp.float32, sharding=res),
                   jax.ShapeDtypeStruct((T, 2), jnp.int32, sharding=tok)]
    partition = {"forward": mok_jax._src.sharding._forward_partition,
                 "forward_saving": mok_jax._src.sharding._forward_saving_partition,
                 "backward": mok_jax._src.sharding._backward_partition}[which]
    recipe = mok_jax.Recipe.NATIVE
    static = (3, "xla", recipe) if which == "forward" else (3, "xla", recipe, bound)
    with jax.set_mesh(mesh):
        _, per_device, _, _ = partition(*static, mesh, shapes, None)
        local = [jax.ShapeDtypeStruct(s.sharding.shard_shape(s.shape), s.dtype) for s in shapes]
        jaxpr = jax.make_jaxpr(per_device, axis_env=list(mesh.shape.items()))(*local)
    assert _mesh_typed_values(jaxpr.jaxpr) == []


def test_plain_jit_dp_ep_mesh_keeps_global_semantics():
    x, ids, w, wgu, wd = problem(jnp.float32, seed=3)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, 0.6)
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=CPUS[:8])
    y, s, g, hlo = jit_on_mesh(mesh, P(("dp", "ep")), P("ep"), x, ids, w, wgu, wd, 0.6)
    assert_same_bits(y, y1, "y")
    assert_same_bits(g[0], g1[0], "dx")
    assert_same_bits(g[1], g1[1], "d_expert_weights")
    # Replicated experts add the dp groups' partial weight gradients (psum): each
    # partial has the bits of one device on that group's tokens under the global
    # plan (pairs the global plan drops get invalid ids there).
    _, _, _, keep = np_stats(ids, E, mok_jax.capacity(0.6, T, K, E))
    half = T // 2
    parts = [single_device(x[i * half:(i + 1) * half], jnp.where(
        keep[i * half:(i + 1) * half], ids[i * half:(i + 1) * half], -1).astype(jnp.int32),
        w[i * half:(i + 1) * half], wgu, wd, None)[2] for i in range(2)]
    assert_same_bits(g[2], parts[0][2] + parts[1][2], "d_w_gate_up")
    assert_same_bits(g[3], parts[0][3] + parts[1][3], "d_w_down")
    assert int(s.dropped) == int(s1.dropped) > 0   # capacity over the global batch
    assert set(gathered_types(hlo)) <= {"s32"}


def test_replicated_experts_are_pure_data_parallelism():
    x, ids, w, wgu, wd = problem(jnp.float32, seed=4)
    y1, _, g1 = single_device(x, ids, w, wgu, wd, None)
    mesh = jax.make_mesh((4,), ("dp",), devices=CPUS[:4])
    y, _, g, hlo = jit_on_mesh(mesh, P("dp"), P(), x, ids, w, wgu, wd, None)
    assert_same_bits(y, y1, "y")
    assert_same_bits(g[0], g1[0], "dx")
    assert "all-to-all" not in hlo
    assert set(gathered_types(hlo)) <= {"s32"}


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_data_parallel_mesh_runs_the_single_device_layer_per_device(axis_type):
    """Experts not split and no capacity: each device runs the one-FFI-call layer on
    its own tokens (no routing plan over the mesh: nothing is gathered, not even
    ids), with the single device's bits for y, dx and d expert_weights, global
    statistics, and weight gradients that are the sum of the two halves'."""
    types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    mesh = jax.make_mesh((2, 1), ("dp", "ep"), devices=CPUS[:2],
                         axis_types=(types[axis_type],) * 2)
    x, ids, w, wgu, wd = problem(jnp.float32, seed=8)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, None)
    with jax.set_mesh(mesh):
        y, s, g, hlo = jit_on_mesh(mesh, P(("dp", "ep")), P("ep"), x, ids, w, wgu, wd, None,
                                   backend="auto")
    assert hlo.count('custom_call_target="mok_moe_fwd"') == 1
    assert hlo.count('custom_call_target="mok_moe_bwd"') == 1
    assert "mok_expert_ffn" not in hlo and "all-gather" not in hlo
    assert_same_bits(y, y1, "y")
    assert_same_bits(g[0], g1[0], "dx")
    assert_same_bits(g[1], g1[1], "d_expert_weights")
    np.testing.assert_array_equal(s.tokens_per_expert, s1.tokens_per_expert)
    assert int(s.invalid) == int(s1.invalid) > 0 and int(s.dropped) == 0
    half = T // 2
    parts = [single_device(x[i * half:(i + 1) * half], ids[i * half:(i + 1) * half],
                           w[i * half:(i + 1) * half], wgu, wd, None)[2] for i in range(2)]
    assert_same_bits(g[2], parts[0][2] + parts[1][2], "d_w_gate_up")
    assert_same_bits(g[3], parts[0][3] + parts[1][3], "d_w_down")
    # With a capacity the plan is global (lowest token indices over both devices
    # kept first): the EP layer runs, and the single device's pairs are dropped.
    with jax.set_mesh(mesh):
        _, s, _, hlo = jit_on_mesh(mesh, P(("dp", "ep")), P("ep"), x, ids, w, wgu, wd, 0.6,
                                   backend="auto")
    assert 'custom_call_target="mok_expert_ffn_fwd"' in hlo
    assert int(s.dropped) == int(single_device(x, ids, w, wgu, wd, 0.6)[1].dropped) > 0


def test_experts_not_divisible_by_the_ep_axis_is_an_error():
    x, ids, w, wgu, wd = problem(jnp.float32)
    mesh = jax.make_mesh((8,), ("ep",), devices=CPUS[:8])
    wgu6, wd6 = jax.device_put((jnp.zeros((6, H, 2 * F)), jnp.zeros((6, F, H))), CPUS[0])
    # Under shard_map, jax refuses to split 6 experts over 8 ranks.
    with pytest.raises(ValueError, match="evenly divid"):
        jax.shard_map(lambda *a: mok_jax.moe(*a, axis_name="ep"), mesh=mesh,
                      in_specs=(P("ep"),) * 5, out_specs=P("ep"), check_vma=True)(
            x, jnp.clip(ids, 0, 5), w, wgu6, wd6)
    # Under plain jit, mok_jax's partitioner refuses a padded experts dimension.
    with pytest.raises(ValueError, match=r"E % P != 0"):
        mok_jax._src.sharding._layout(mesh, NamedSharding(mesh, P("ep")),
                                 NamedSharding(mesh, P("ep")), num_experts=6)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
@pytest.mark.parametrize("experts", ["split", "replicated",
                                     pytest.param("split, tokens replicated",
                                                  marks=pytest.mark.slow),
                                     pytest.param("split, dp2 x ep2", marks=pytest.mark.slow)])
def test_tokens_not_dividing_their_mesh_axes_give_the_single_device_results(
        experts, capacity_factor):
    """XLA may split T tokens unevenly (a with_sharding_constraint of 30 tokens over 4
    devices; or tokens left replicated while the experts split over 4, which mok_jax
    then splits along the EP axis) and pads the last shard. The padding rows are
    neither routed nor counted: y, the gradients and the statistics are the
    single-device call's (the statistics once counted the padding, and with them a
    router's balance loss). Replicated experts are data parallelism: their gradients
    are sums over the devices, equal up to summation order."""
    two_axes = experts.endswith("dp2 x ep2")
    mesh = jax.make_mesh((2, 2) if two_axes else (4,), ("dp", "ep") if two_axes else ("ep",),
                         devices=CPUS[:4], axis_types=(jax.sharding.AxisType.Auto,) * (
                             2 if two_axes else 1))
    full = jax.device_put(problem(jnp.float32, seed=4), NamedSharding(mesh, P()))
    x, ids, w, wgu, wd = (a[:30] if i < 3 else a for i, a in enumerate(full))
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, capacity_factor)
    if capacity_factor is not None:
        assert int(s1.dropped) > 0  # the limit bites
    c = lambda v, spec=P("ep"): jax.lax.with_sharding_constraint(v, NamedSharding(mesh, spec))

    def loss(x, w, wgu, wd, ids):
        if experts.startswith("split"):
            wgu, wd = c(wgu), c(wd)
        if experts != "split, tokens replicated":
            spec = P(("dp", "ep")) if two_axes else P("ep")
            x, ids, w = c(x, spec), c(ids, spec), c(w, spec)
        y, s = mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=capacity_factor,
                           return_stats=True)
        return jnp.sum(y.astype(jnp.float32) * cot(x.shape[1])), (y, s)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (y, s)), g = step(x, w, wgu, wd, ids)
    if experts == "replicated" or two_axes:  # a data-parallel axis sums the weights' grads
        assert_same_results((y, *g[:2]), (y1, *g1[:2]))
        for name, a, b in zip(("d_w_gate_up", "d_w_down"), g[2:], g1[2:]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
    else:
        assert_same_results((y, *g), (y1, *g1))
    np.testing.assert_array_equal(s.tokens_per_expert, s1.tokens_per_expert)
    assert int(s.dropped) == int(s1.dropped) and int(s.invalid) == int(s1.invalid)


@pytest.mark.parametrize("tokens, routing", [(6, "random"), (30, "the last device's experts")])
def test_padded_token_split_keeps_the_ep_residuals(tokens, routing):
    """Experts split over 4 devices, tokens left replicated and T not a multiple of
    4: XLA pads the tokens for the exchange, and the padded part of the last shard
    (all of it at T = 6) is cut from everything typed as split like the tokens. The
    last device's experts' saved rows must not go with it (at T = 30 they receive
    90 rows, more than the 72 of the shard that survive): y, the gradients and the
    statistics are the single-device call's."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])  # Explicit axes
    x, ids, w, wgu, wd = (a[:tokens] if i < 3 else a
                          for i, a in enumerate(problem(jnp.float32, seed=5)))
    if routing != "random":  # every pair to expert 6 or 7, the last device's
        ids = jnp.broadcast_to(jnp.array([E - 1, E - 2, E - 1], jnp.int32), ids.shape)
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, None)
    with jax.set_mesh(mesh):
        y, s, g, _ = jit_on_mesh(mesh, P(), P("ep"), x, ids, w, wgu, wd, None)
    assert_same_results((y, *g), (y1, *g1))
    np.testing.assert_array_equal(s.tokens_per_expert, s1.tokens_per_expert)
    assert int(s.invalid) == int(s1.invalid)


@pytest.mark.parametrize("experts", ["split", "replicated"])
def test_plain_jit_gradients_of_no_tokens_on_a_mesh(experts):
    """T = 0 on a mesh of 4 devices: the forward saves its (empty) rows for the
    backward like any even split. y, dx and d expert_weights are empty, the weight
    gradients and statistics those of one device with no tokens (all zero)."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    x, ids, w, wgu, wd = (a[:0] if i < 3 else a
                          for i, a in enumerate(problem(jnp.float32, seed=11)))
    y1, s1, g1 = single_device(x, ids, w, wgu, wd, 1.0)
    y, s, g, _ = jit_on_mesh(mesh, P("ep"), P("ep") if experts == "split" else P(),
                             x, ids, w, wgu, wd, 1.0)
    assert y.shape == (0, H) and g[0].shape == (0, H) and g[1].shape == (0, K)
    assert_same_results((y, *g), (y1, *g1))
    assert not np.any(np.asarray(g[2])) and not np.any(np.asarray(g[3]))
    np.testing.assert_array_equal(s.tokens_per_expert, np.zeros(E, np.int32))
    assert int(s.dropped) == int(s.invalid) == 0


@pytest.mark.parametrize("tokens, returned", [(31, "as XLA chooses"), (32, "replicated")])
@pytest.mark.parametrize("experts", ["replicated", "split"])
def test_a_vjp_across_two_jits_gives_the_single_device_bits(experts, tokens, returned):
    """jax.vjp's forward in one jit, its backward in another, the tokens split over 4
    devices. 31 tokens: the first jit cannot return the saved rows split unevenly
    (JAX arrays have no uneven shardings) and gathers them, and the second sees
    replicated tokens. 32 tokens returned replicated (out_shardings): the saved
    rows arrive gathered. The gradients are still the single-device call's (weight
    gradients to summation order where the experts are replicated: a data-parallel
    sum)."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x, ids, w, wgu, wd = (a[:tokens] if i < 3 else a
                          for i, a in enumerate(problem(jnp.float32, seed=6)))
    dy = cot(x.shape[1]) * jnp.ones((tokens, 1))
    layer = lambda ids: lambda x, w, wgu, wd: mok_jax.moe(x, ids, w, wgu, wd)  # noqa: E731
    _, pullback = jax.vjp(layer(ids), x, w, wgu, wd)
    g1 = pullback(dy)
    split = NamedSharding(mesh, P("ep"))

    def forward(x, w, wgu, wd, ids):
        x, w, ids = (jax.lax.with_sharding_constraint(a, split) for a in (x, w, ids))
        if experts == "split":
            wgu, wd = (jax.lax.with_sharding_constraint(a, split) for a in (wgu, wd))
        return jax.vjp(layer(ids), x, w, wgu, wd)

    args = jax.device_put((x, w, wgu, wd, ids, dy), NamedSharding(mesh, P()))
    out = NamedSharding(mesh, P()) if returned == "replicated" else None
    with jax.set_mesh(mesh):
        _, pullback = jax.jit(forward, out_shardings=out)(*args[:5])
        g = jax.jit(lambda pullback, dy: pullback(dy))(pullback, args[5])
    if experts == "split":
        assert_same_results(g, g1, names=("dx", "d_expert_weights", "d_w_gate_up", "d_w_down"))
    else:
        assert_same_results(g[:2], g1[:2], names=("dx", "d_expert_weights"))
        for name, a, b in zip(("d_w_gate_up", "d_w_down"), g[2:], g1[2:]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("experts, moved_to, outcome", [
    ("replicated", ("dp",), "nan"),               # the single-device layer reads them
    ("split", ("ep", "dp"), "nan"),               # EP reads them
    ("split", ("dp",), "single device"),          # EP needs the tokens over ep: it recomputes
    ("replicated", "renamed axes", "single device"),  # the same blocks, other axis names
    ("split", "renamed axes", "single device"),
])
def test_saved_rows_resharded_between_two_jits_give_nan_not_wrong_gradients(
        experts, moved_to, outcome):
    """jax.vjp's forward in one jit with the tokens split over ("dp", "ep"), its
    backward in another after the saved rows (and x, ids, weights) were moved to
    another even split. The rows are blocks of the first split, meaningless under
    another, and where the backward takes the new split as its own nothing static
    tells it: the gradients are NaN (every valid pair's), never wrong numbers.
    Where the new split is not one the backward can take, it runs the forward again
    (the single-device gradients); moved to a mesh of the same devices whose axes
    have other names, the blocks are the same and are read; unmoved, the pullback
    gives the single-device gradients too (weight gradients to summation order: "dp"
    is a data-parallel axis)."""
    mesh = jax.make_mesh((2, 2), ("dp", "ep"), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, ids, w, wgu, wd = problem(jnp.float32, seed=9)
    dy = cot(x.shape[1]) * jnp.ones((T, 1))
    layer = lambda ids: lambda x, w, wgu, wd: mok_jax.moe(x, ids, w, wgu, wd)  # noqa: E731
    _, pullback = jax.vjp(layer(ids), x, w, wgu, wd)
    g1 = pullback(dy)
    first = NamedSharding(mesh, P(("dp", "ep")))

    def forward(x, w, wgu, wd, ids):
        x, w, ids = (jax.lax.with_sharding_constraint(a, first) for a in (x, w, ids))
        if experts == "split":
            wgu, wd = (jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P("ep")))
                       for a in (wgu, wd))
        return jax.vjp(layer(ids), x, w, wgu, wd)

    args = jax.device_put((x, w, wgu, wd, ids, dy), NamedSharding(mesh, P()))
    backward = jax.jit(lambda pullback, dy: pullback(dy))
    with jax.set_mesh(mesh):
        _, pullback = jax.jit(forward)(*args[:5])
        g_unmoved = backward(pullback, args[5])
    leaves, tree = jax.tree.flatten(pullback)
    if moved_to == "renamed axes":
        backward_mesh = jax.sharding.Mesh(mesh.devices, ("a", "b"), axis_types=mesh.axis_types)
        name = {"dp": "a", "ep": "b"}
        rename = lambda e: (e if e is None else name[e] if isinstance(e, str)  # noqa: E731
                            else tuple(name[n] for n in e))
        moved = [jax.device_put(a, NamedSharding(backward_mesh, P(*map(rename, a.sharding.spec))))
                 if isinstance(getattr(a, "sharding", None), NamedSharding) else a
                 for a in leaves]
    else:
        backward_mesh = mesh
        token_split = [a for a in leaves if getattr(a, "sharding", None) is not None
                       and a.sharding.is_equivalent_to(first, a.ndim) and a.shape[0] == T]
        assert len(token_split) >= 5  # x, ids, weights and the saved rows
        to = NamedSharding(mesh, P(moved_to))
        moved = [jax.device_put(a, to) if any(a is b for b in token_split) else a
                 for a in leaves]
    with jax.set_mesh(backward_mesh):
        g = backward(jax.tree.unflatten(tree, moved),
                     jax.device_put(dy, NamedSharding(backward_mesh, P())))
    names = ("dx", "d_expert_weights", "d_w_gate_up", "d_w_down")
    results = [g_unmoved] if outcome == "nan" else [g_unmoved, g]
    if outcome == "nan":
        valid = np.asarray((ids >= 0) & (ids < E))
        assert 0 < valid.sum() < valid.size  # the problem has invalid ids (d weight 0)
        for name, a in zip(names, g):
            a = np.asarray(a)
            assert np.isnan(a[valid] if name == "d_expert_weights" else a).all(), name
    for got in results:  # weight gradients: sums over the data axis, to summation order
        assert_same_results(got[:2], g1[:2], names=names[:2])
        for name, a, b in zip(names[2:], got[2:], g1[2:]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


def test_shard_map_manual_over_the_ep_axis_only_is_bitwise_equal_to_one_device():
    """shard_map manual over "ep" alone on a (dp, ep) mesh, dp left to XLA: the
    routing plan's prefix sums once went through jnp.searchsorted, which failed to
    trace there (an AssertionError inside JAX). y and every gradient are the
    single-device call's bits (each expert's rows on one device, in global order)."""
    mesh = jax.make_mesh((2, 2), ("dp", "ep"), devices=CPUS[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, ids, w, wgu, wd = problem(jnp.float32, seed=10)
    y1, _, g1 = single_device(x, ids, w, wgu, wd, None)
    layer = jax.shard_map(lambda *a: mok_jax.moe(*a, axis_name="ep"), mesh=mesh,
                          in_specs=(P("ep"),) * 5, out_specs=P("ep"), axis_names={"ep"})
    x, ids, w, wgu, wd = jax.device_put((x, ids, w, wgu, wd), NamedSharding(mesh, P()))

    def loss(x, w, wgu, wd):
        y = layer(x, ids, w, wgu, wd)
        return jnp.sum(y * cot(H)), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        x, w, wgu, wd)
    assert_same_results((y, *g), (y1, *g1))


def test_unknown_axis_name_is_an_error():
    x, ids, w, wgu, wd = problem(jnp.float32)
    mesh = jax.make_mesh((2,), ("ep",), devices=CPUS[:2])
    args = [jax.device_put(a, NamedSharding(mesh, P("ep"))) for a in (x, ids, w, wgu, wd)]
    with pytest.raises(ValueError, match="axis_name='tp' is not a bound mesh axis"):
        jax.shard_map(lambda *a: mok_jax.moe(*a, axis_name="tp"), mesh=mesh,
                      in_specs=(P("ep"),) * 5, out_specs=P("ep"), check_vma=True)(*args)


def test_pairs_of_all_token_shards_past_int32_raise_at_trace_time():
    """Every rank plans over the pairs of all token shards (G * T * K) and the
    transports number the grouped rows, both in int32: 8 shards of 2^25 tokens x 8
    pairs (2^28 each, within one call's limit, 2^31 together) are a ValueError naming
    the limit when traced, not an OverflowError from inside JAX (nothing is
    allocated: abstract arrays); 8 shards of 2^24 tokens trace."""
    mesh = jax.make_mesh((8,), ("ep",), devices=CPUS[:8])
    shard = NamedSharding(mesh, P("ep"))

    def structs(tokens_per_shard):
        t = 8 * tokens_per_shard
        shapes = (((t, 8), jnp.bfloat16), ((t, 8), jnp.int32), ((t, 8), jnp.float32),
                  ((8, 8, 16), jnp.bfloat16), ((8, 8, 8), jnp.bfloat16))
        return [jax.ShapeDtypeStruct(s, d, sharding=shard) for s, d in shapes]

    layer = jax.shard_map(lambda *a: mok_jax.moe(*a, axis_name="ep", backend="xla"),
                          mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))
    with pytest.raises(ValueError, match=r"G \* T \* K .* = 2147483648 exceeds 2147483646"):
        jax.eval_shape(layer, *structs(2**25))
    assert jax.eval_shape(layer, *structs(2**24)).shape == (2**27, 8)


def test_grouped_rows_past_int32_raise_at_trace_time():
    """Grouped buffers of 2^31 - 1 rows (more than the exchange group's pairs, as
    the partitioned layer may ask for): XLA's exchange maps cannot number them and
    one past them, which is a ValueError naming the limit."""
    from mok_jax._src import ep
    from mok_jax.recipe import Recipe
    cfg = ep.Config(None, 1, -1, (), Recipe.NATIVE)
    ids = jax.ShapeDtypeStruct((4, 2), jnp.int32)
    path = ep.ExchangePath(cfg, "xla", rows=2**31 - 1)
    with pytest.raises(ValueError, match=r"expert-grouped rows .* = 2147483647 exceeds"):
        jax.eval_shape(lambda i: path.routing(i, 4), ids)
    ok = ep.ExchangePath(cfg, "xla", rows=2**31 - 2)
    jax.eval_shape(lambda i: ok.routing(i, 4), ids)


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
@pytest.mark.parametrize("mesh_shape", [(4,), pytest.param((2, 2), marks=pytest.mark.slow)],
                         ids=["ep4", "dp2xep2"])
def test_plain_jit_backward_uses_the_forward_residuals(axis_type, mesh_shape):
    """Under plain jit the forward's custom partitioning hands each device's grouped
    inputs and projections to the backward: the compiled forward+backward runs the
    expert forward once (it ran it twice when the backward recomputed it), gathers
    no floats, and still gives one device's bits."""
    names = ("ep",) if len(mesh_shape) == 1 else ("dp", "ep")
    types = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    mesh = jax.make_mesh(mesh_shape, names, devices=CPUS[:4],
                         axis_types=(types[axis_type],) * len(names))
    x, ids, w, wgu, wd = problem(jnp.float32, seed=21)
    y1, _, g1 = single_device(x, ids, w, wgu, wd, 0.75)
    with jax.set_mesh(mesh):
        y, _, g, hlo = jit_on_mesh(mesh, P(names), P("ep"), x, ids, w, wgu, wd, 0.75)
    assert hlo.count('custom_call_target="mok_expert_ffn_fwd"') == 1
    assert hlo.count('custom_call_target="mok_expert_ffn_bwd"') == 1
    assert [t for t in gathered_types(hlo) if t not in ("s32", "u32", "pred")] == []
    assert_same_bits(y, y1, "y")
    assert_same_bits(g[0], g1[0], "dx")
    assert_same_bits(g[1], g1[1], "d_expert_weights")
    if names == ("ep",):  # no data axis: the weight gradients have one device's bits too
        assert_same_bits(g[2], g1[2], "d_w_gate_up")
        assert_same_bits(g[3], g1[3], "d_w_down")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["one device", "one device xla", "shard_map ep4",
                                   "plain jit ep8"])
def test_x64_mode_gives_the_same_bits_and_int32_statistics(where):
    """With ``jax_enable_x64`` on, JAX's integer reductions default to int64; every
    path must still hand its kernels int32 and give the bits of an x64-off run (the
    plan's group sizes were once int64 there, which the kernels refused at run
    time)."""
    x, ids, w, wgu, wd = problem(jnp.float32, seed=3)
    mesh4 = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    mesh8 = jax.make_mesh((8,), ("ep",), devices=CPUS[:8])
    runs = {
        "one device": lambda: single_device(x, ids, w, wgu, wd, 0.6),
        "one device xla": lambda: single_device(x, ids, w, wgu, wd, 0.6, backend="xla"),
        "shard_map ep4": lambda: shard_map_ep(mesh4, P("ep"), x, ids, w, wgu, wd, 0.6),
        "plain jit ep8": lambda: jit_on_mesh(mesh8, P("ep"), P("ep"), x, ids, w, wgu, wd,
                                             0.6)[:3],
    }
    y1, s1, g1 = runs[where]()
    with jax.enable_x64(True):
        y, s, g = runs[where]()
        jax.block_until_ready((y, s, g))
    assert_same_results((y, *g), (y1, *g1))
    for name in ("tokens_per_expert", "dropped", "invalid"):
        got, want = getattr(s, name), getattr(s1, name)
        assert got.dtype == want.dtype == jnp.int32, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert int(s.dropped) > 0
