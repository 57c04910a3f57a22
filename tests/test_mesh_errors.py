"""Misconfigured meshes and options give a ValueError at trace time, never a silent
wrong answer (on 8 host devices, conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mok_jax

T, K, E, H, F = 32, 2, 8, 16, 8
CPUS = jax.devices("cpu")


def _problem(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, H))
    w, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(ks[1], (T, E))), K)
    wgu = jax.random.normal(ks[2], (E, H, 2 * F)) * H**-0.5
    wd = jax.random.normal(ks[3], (E, F, H)) * F**-0.5
    return jax.device_put((x, ids.astype(jnp.int32), w, wgu, wd), CPUS[0])


def _shard_map(mesh, token_spec, weight_spec, check_vma=True, **kw):
    """The layer under shard_map; places its arguments as in_specs say."""
    def local(x, ids, w, wgu, wd):  # statistics per rank, stacked
        y, stats = mok_jax.moe(x, ids, w, wgu, wd, return_stats=True, **kw)
        return y, jax.tree.map(lambda v: v[None], stats)
    specs = (token_spec,) * 3 + (weight_spec,) * 2
    layer = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs,
                                  out_specs=(token_spec, P(*mesh.axis_names)),
                                  check_vma=check_vma))
    return lambda *args: layer(*(jax.device_put(a, NamedSharding(mesh, s))
                                 for a, s in zip(args, specs)))


def test_sharded_experts_without_axis_name_is_an_error():
    """The silent wrong answer users hit: each rank took its 2 experts for all 8."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    with pytest.raises(ValueError, match=r"w_gate_up varies over mesh axis 'ep'.*axis_name='ep'"):
        _shard_map(mesh, P("ep"), P("ep"))(*_problem())


def test_replicated_experts_with_axis_name_is_an_error():
    """Replicated weights with axis_name would make E = 4 x 8 = 32 experts."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    with pytest.raises(ValueError, match=r"w_gate_up does not vary over axis_name 'ep'"):
        _shard_map(mesh, P("ep"), P(), axis_name="ep")(*_problem())


def test_experts_split_over_two_axes_under_shard_map_is_an_error():
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=CPUS[:8])
    x, ids, w, wgu, wd = _problem()
    wgu, wd = jnp.tile(wgu, (2, 1, 1)), jnp.tile(wd, (2, 1, 1))   # 16 experts over 8 ranks
    with pytest.raises(ValueError, match=r"also varies over 'dp'"):
        _shard_map(mesh, P(("dp", "ep")), P(("dp", "ep")), axis_name="ep")(x, ids, w, wgu, wd)


def test_data_parallel_shard_map_without_axis_name_is_allowed_and_per_shard():
    """Tokens split, experts replicated: each shard is its own call (allowed)."""
    mesh = jax.make_mesh((4,), ("dp",), devices=CPUS[:4])
    x, ids, w, wgu, wd = _problem(1)
    y, _ = _shard_map(mesh, P("dp"), P())(x, ids, w, wgu, wd)
    q = T // 4
    want = jnp.concatenate([mok_jax.moe(x[i * q:(i + 1) * q], ids[i * q:(i + 1) * q],
                                        w[i * q:(i + 1) * q], wgu, wd) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_check_vma_false_is_the_documented_way_out():
    """Without check_vma JAX tracks no varying axes; mok_jax runs what it is given:
    here each rank's 2 local experts as a 2-expert model (ids >= 2 are invalid)."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    x, ids, w, wgu, wd = _problem(2)
    y, stats = _shard_map(mesh, P("ep"), P("ep"), check_vma=False)(x, ids, w, wgu, wd)
    invalid = np.asarray(stats.invalid).reshape(-1)
    q = T // 4
    want = [int(np.sum((np.asarray(ids[i * q:(i + 1) * q]) >= 2))) for i in range(4)]
    np.testing.assert_array_equal(invalid, want)


def test_traced_capacity_factor_says_static_argnames():
    x, ids, w, wgu, wd = _problem()
    with pytest.raises(ValueError, match=r"capacity_factor.*static_argnames"):
        jax.jit(mok_jax.moe)(x, ids, w, wgu, wd, capacity_factor=1.25)
    # the pattern the message points to works
    y = jax.jit(mok_jax.moe, static_argnames=("capacity_factor",))(
        x, ids, w, wgu, wd, capacity_factor=1.25)
    np.testing.assert_array_equal(y, mok_jax.moe(x, ids, w, wgu, wd, capacity_factor=1.25))


def test_traced_return_stats_says_static_argnames():
    x, ids, w, wgu, wd = _problem()
    with pytest.raises(ValueError, match=r"return_stats.*static_argnames"):
        jax.jit(mok_jax.moe)(x, ids, w, wgu, wd, return_stats=True)


@pytest.mark.parametrize("value,match", [("yes", "return_stats must be True or False"),
                                         (("ep",), "axis_name must be None or the name")])
def test_option_types(value, match):
    kw = {"return_stats": value} if isinstance(value, str) else {"axis_name": value}
    with pytest.raises(ValueError, match=match):
        mok_jax.moe(*_problem(), **kw)


def _explicit_mesh(shape, names):
    return jax.make_mesh(shape, names, devices=CPUS[:int(np.prod(shape))],
                         axis_types=(AxisType.Explicit,) * len(shape))


@pytest.mark.parametrize("case,match", [
    ("experts over two axes", r"experts dim of w_gate_up is split over \('dp', 'ep'\)"),
    ("w_down split differently", r"w_gate_up's experts dim is split over \('ep',\) but w_down's"),
    ("x split along H", r"x's H dim is split over \('dp',\)"),
    ("w_gate_up split along F", r"w_gate_up's H or 2F dim is split over \('dp',\)"),
])
def test_plain_jit_layouts_it_cannot_run_as_asked_are_errors(case, match):
    mesh = _explicit_mesh((2, 4), ("dp", "ep"))
    x, ids, w, wgu, wd = _problem(3)
    s = {"x": P("ep"), "wgu": P("ep"), "wd": P("ep")}
    if case == "experts over two axes":
        s["wgu"] = s["wd"] = P(("dp", "ep"))
    elif case == "w_down split differently":
        s["wd"] = P("dp")
    elif case == "x split along H":
        s["x"] = P("ep", "dp")
    else:
        s["wgu"] = P("ep", None, "dp")
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(x, s["x"]), put(ids, P("ep")), put(w, P("ep")), put(wgu, s["wgu"]),
            put(wd, s["wd"]))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
        jax.jit(mok_jax.moe)(*args)


@pytest.mark.parametrize("axis_types", [AxisType.Explicit, AxisType.Auto])
def test_experts_over_a_size_one_axis_and_the_ep_axis(axis_types):
    """An axis of size 1 splits nothing: experts over ("dp", "ep") with dp of size 1
    run as experts over "ep" alone, with the same bits, x's H dim over dp too."""
    x, ids, w, wgu, wd = _problem(5)
    mesh = jax.make_mesh((1, 4), ("dp", "ep"), devices=CPUS[:4], axis_types=(axis_types,) * 2)

    def run(expert_spec, x_spec):
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(x, x_spec), put(ids, P("ep")), put(w, P("ep")), put(wgu, expert_spec),
                put(wd, expert_spec))
        with jax.set_mesh(mesh):
            return jax.jit(mok_jax.moe)(*args)

    y = run(P(("dp", "ep")), P("ep", "dp"))
    np.testing.assert_array_equal(y, run(P("ep"), P("ep")))
    np.testing.assert_array_equal(y, mok_jax.moe(x, ids, w, wgu, wd))


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "numpy"])
@pytest.mark.parametrize("case, match", [
    pytest.param("experts over two axes", r"experts dim of w_gate_up is split over "
                 r"\('dp', 'ep'\)", id="two-axes"),
    pytest.param("6 experts over 4", r"E=6 experts do not split evenly .* \(E % P != 0\)",
                 id="uneven")])
def test_auto_layouts_the_partitioner_refuses(case, match, placed):
    """With Auto axes the layout is XLA's. Expert weights constrained over two axes
    or unevenly reach the partitioner, which refuses them at compile time, when
    the operands are placed on the mesh; operands from the host (numpy) XLA
    gathers before the call, which then gives the single-device bits
    (docs/contract.md says both)."""
    x, ids, w, wgu, wd = _problem(4)
    spec = P(("dp", "ep")) if case == "experts over two axes" else P("ep")
    if case == "6 experts over 4":
        ids, wgu, wd = ids % 6, wgu[:6], wd[:6]
    mesh = jax.make_mesh((2, 4), ("dp", "ep"), devices=CPUS[:8],
                         axis_types=(AxisType.Auto,) * 2)
    c = jax.lax.with_sharding_constraint
    args = (x, ids, w, wgu, wd)
    args = (jax.device_put(args, NamedSharding(mesh, P())) if placed
            else [np.asarray(a) for a in args])
    step = jax.jit(lambda x, ids, w, wgu, wd: mok_jax.moe(x, ids, w, c(wgu, spec), c(wd, spec)))
    with jax.set_mesh(mesh):
        if placed:
            with pytest.raises(Exception, match=match):
                step(*args)
            return
        y = step(*args)
    np.testing.assert_array_equal(y, mok_jax.moe(x, ids, w, wgu, wd))


def test_the_mesh_mistake_is_named_before_k_exceeds_local_experts():
    """8 experts over 8 ranks leave 1 per rank, fewer than K=2: the error must name
    the missing axis_name (the cause), not K > E (a symptom)."""
    mesh = jax.make_mesh((8,), ("ep",), devices=CPUS[:8])
    with pytest.raises(ValueError, match=r"axis_name='ep'"):
        _shard_map(mesh, P("ep"), P("ep"))(*_problem())


def test_tokens_replicated_over_the_ep_axis_is_an_error():
    """Every EP rank would hold the same tokens and count them P times."""
    mesh = jax.make_mesh((4,), ("ep",), devices=CPUS[:4])
    with pytest.raises(ValueError, match=r"x does not vary over axis_name 'ep'"):
        _shard_map(mesh, P(), P("ep"), axis_name="ep")(*_problem())


def test_check_mesh_false_lets_fsdp_gathered_weights_through():
    """Weights stored split over 'dp' and all-gathered inside shard_map hold every
    expert but vary over 'dp' in type: check_mesh=False is the documented way."""
    mesh = jax.make_mesh((4,), ("dp",), devices=CPUS[:4])
    x, ids, w, wgu, wd = _problem(4)

    def local(x, ids, w, wgu, wd, check):
        wgu, wd = (jax.lax.all_gather(a, "dp", tiled=True) for a in (wgu, wd))
        return mok_jax.moe(x, ids, w, wgu, wd, check_mesh=check)

    def run(check):
        f = jax.shard_map(lambda *a: local(*a, check), mesh=mesh,
                          in_specs=(P("dp"),) * 5, out_specs=P("dp"))
        specs = (P("dp"),) * 5
        return jax.jit(f)(*(jax.device_put(a, NamedSharding(mesh, s))
                            for a, s in zip((x, ids, w, wgu, wd), specs)))

    with pytest.raises(ValueError, match="check_mesh=False"):
        run(True)
    q = T // 4
    want = jnp.concatenate([mok_jax.moe(x[i * q:(i + 1) * q], ids[i * q:(i + 1) * q],
                                        w[i * q:(i + 1) * q], wgu, wd) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(run(False)), np.asarray(want))
