"""mok_jax.nn.MoE: parameters and their logical shardings, routing, forward against
the reference, auxiliary losses against a NumPy hand computation, gradients,
bias-based balancing, and the layer under jit on sharded meshes and inside shard_map."""

import contextlib
import doctest

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mok_jax
import mok_jax.nn as mnn
from mok_jax import router
from mok_jax.reference import moe_reference

from conftest import BF16, assert_bitwise, assert_close, script_env

H, F, E, K = 16, 24, 8, 2


def make_layer(**kw):
    args = dict(hidden_size=H, ffn_size=F, num_experts=E, top_k=K, rngs=nnx.Rngs(0))
    args.update(kw)
    return mnn.MoE(**args)


def tokens(T=64, seed=1, shape=None):
    return jax.random.normal(jax.random.key(seed), shape or (T, H), jnp.float32)


def mesh_of(dp, ep, axis_type=AxisType.Auto):
    devices = np.array(jax.devices()[:dp * ep], dtype=object).reshape(dp, ep)
    return jax.sharding.Mesh(devices, ("dp", "ep"), axis_types=(axis_type,) * 2)


def np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# --------------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_docstring_examples_run():
    result = doctest.testmod(mnn, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0, result


def test_parameters_shapes_dtypes_and_logical_axes():
    layer = make_layer(shared_ffn_size=12, balance_bias=True, param_dtype=jnp.bfloat16)
    assert layer.router.kernel.shape == (H, E)
    assert layer.w_gate_up.shape == (E, H, 2 * F)
    assert layer.w_down.shape == (E, F, H)
    assert layer.shared_gate_up.shape == (H, 24) and layer.shared_down.shape == (12, H)
    for p in (layer.router.kernel, layer.w_gate_up, layer.w_down, layer.shared_gate_up):
        assert p.dtype == BF16
    axes = {name: v.get_metadata()["out_sharding"] for name, v in [
        ("router", layer.router.kernel), ("w_gate_up", layer.w_gate_up),
        ("w_down", layer.w_down), ("shared_gate_up", layer.shared_gate_up),
        ("shared_down", layer.shared_down)]}
    assert axes == {"router": ("embed", None), "w_gate_up": ("expert", "embed", "mlp"),
                    "w_down": ("expert", "mlp", "embed"), "shared_gate_up": ("embed", "mlp"),
                    "shared_down": ("mlp", "embed")}
    # The balancing bias is state, not a trainable parameter.
    assert layer.balance_bias.dtype == np.float32 and layer.balance_bias.shape == (E,)
    params = nnx.state(layer, nnx.Param)
    assert "balance_bias" not in params
    assert set(nnx.state(layer, mnn.BalanceBias).keys()) == {"balance_bias"}


def test_expert_init_is_lecun_per_expert():
    layer = mnn.MoE(hidden_size=256, ffn_size=128, num_experts=4, top_k=1, rngs=nnx.Rngs(3))
    std_gu = np.std(np.asarray(layer.w_gate_up[...]), axis=(1, 2))
    std_d = np.std(np.asarray(layer.w_down[...]), axis=(1, 2))
    np.testing.assert_allclose(std_gu, 256 ** -0.5, rtol=0.05)
    np.testing.assert_allclose(std_d, 128 ** -0.5, rtol=0.05)
    # Experts differ from each other.
    assert not np.array_equal(layer.w_gate_up[0], layer.w_gate_up[1])


@pytest.mark.parametrize("kw, match", [
    (dict(hidden_size=0), "hidden_size must be a positive int"),
    (dict(hidden_size=16.0), "hidden_size must be a positive int"),
    (dict(ffn_size=-3), "ffn_size must be a positive int"),
    (dict(ffn_size=True), "ffn_size must be a positive int"),
    (dict(num_experts=0), "num_experts must be a positive int"),
    (dict(top_k=0), "top_k must be a positive int"),
    (dict(top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(score_fn="relu"), "score_fn must be one of"),
    (dict(renormalize="yes"), "renormalize must be a bool"),
    (dict(balance_bias=1), "balance_bias must be a bool"),
    (dict(route_scale=0.0), "route_scale must be a positive finite number"),
    (dict(route_scale=float("nan")), "route_scale must be a positive finite number"),
    (dict(route_scale="2.5"), "route_scale must be a positive finite number"),
    (dict(route_scale=10 ** 400), "route_scale must be a positive finite number"),
    (dict(shared_ffn_size=-1), "shared_ffn_size must be an int >= 0"),
    (dict(shared_ffn_size=2.5), "shared_ffn_size must be an int >= 0"),
    (dict(capacity_factor=0), "capacity_factor must be None"),
    (dict(capacity_factor=-1.0), "capacity_factor must be None"),
    (dict(capacity_factor=float("inf")), "capacity_factor must be None"),
    (dict(capacity_factor=True), "capacity_factor must be None"),
    (dict(capacity_factor="1.25"), "capacity_factor must be None"),
    (dict(backend="cuda"), "backend must be one of \\('auto', 'fused', 'xla'\\)"),
    (dict(backend=None), "backend must be one of"),
    (dict(dtype=jnp.float16), "MoE: dtype must be float32 or bfloat16"),
    (dict(dtype="int32"), "MoE: dtype must be float32 or bfloat16"),
    (dict(dtype="not a dtype"), "MoE: dtype must be float32 or bfloat16"),
    (dict(param_dtype=jnp.float16), "MoE: param_dtype must be float32 or bfloat16"),
    (dict(param_dtype=None), "MoE: param_dtype must be float32 or bfloat16"),
    (dict(recipe="fp8", dtype="not a dtype"), "MoE: dtype must be float32 or bfloat16"),
    (dict(recipe="fp8", dtype=object), "MoE: dtype must be float32 or bfloat16"),
    (dict(axis_name=3, batch_axis_names=(3,)), "axis_name must be None or the name"),
    (dict(axis_name=""), "axis_name must be None or the name"),
    (dict(batch_axis_names="dp"), "batch_axis_names must be a sequence"),
    (dict(batch_axis_names=("dp", None)), "batch_axis_names must be a sequence"),
    (dict(batch_axis_names=("dp", "dp")), "batch_axis_names has a repeated axis"),
    (dict(axis_name="ep"), "batch_axis_names=\\(\\) must include axis_name='ep'"),
    (dict(axis_name="ep", batch_axis_names=("dp",)), "must include axis_name='ep'"),
    (dict(router_kernel_init="lecun"), "router_kernel_init must be an initializer"),
    (dict(expert_kernel_init=0.02), "expert_kernel_init must be None or an initializer"),
    (dict(rngs=0), "rngs must be an nnx.Rngs"),
    (dict(rngs=nnx.Rngs(dropout=0)), "rngs must be an nnx.Rngs \\(with a 'params' stream"),
    (dict(router_dot="bf16x3"), "router_dot must be one of \\('auto', 'highest'\\)"),
])
def test_bad_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        make_layer(**kw)


def test_good_construction_variants():
    # The checks accept what they should: NumPy ints, string dtypes, lists of axes.
    layer = make_layer(hidden_size=np.int64(H), top_k=np.int32(K), capacity_factor=np.float32(2),
                       dtype="bfloat16", param_dtype="float32", backend="xla",
                       axis_name="ep", batch_axis_names=["dp", "ep"], route_scale=2,
                       expert_kernel_init=nnx.initializers.normal(0.02))
    assert layer.dtype == BF16 and layer.param_dtype == np.float32
    assert layer.batch_axis_names == ("dp", "ep") and layer.hidden_size == H


def test_initializers_must_make_the_parameters_shape_and_dtype():
    # An initializer that ignores its dtype would leave float32 parameters in a
    # bfloat16 layer (and a float32 computation dtype with dtype=None).
    f32_only = lambda key, shape, dtype: 0.02 * jax.random.normal(key, shape)
    with pytest.raises(ValueError, match=r"MoE: expert_kernel_init made w_gate_up of shape "
                       r"\(8, 16, 48\) and dtype float32, expected \(8, 16, 48\) and bfloat16"):
        make_layer(param_dtype=jnp.bfloat16, expert_kernel_init=f32_only)
    with pytest.raises(ValueError, match=r"MoE: router_kernel_init made router.kernel of shape "
                       r"\(8, 16\) and dtype float32, expected \(16, 8\) and float32"):
        make_layer(router_kernel_init=lambda key, shape, dtype: jnp.zeros(shape[::-1], dtype))
    make_layer(param_dtype=jnp.bfloat16, expert_kernel_init=nnx.initializers.normal(0.02))


def test_float16_is_rejected_at_construction_as_the_layers_dtype():
    # Not later, as a complaint about mok_jax.moe's `x`.
    with pytest.raises(ValueError) as err:
        make_layer(dtype=jnp.float16)
    assert "MoE: dtype" in str(err.value) and "x must" not in str(err.value)
    with pytest.raises(ValueError) as err:
        make_layer(param_dtype=np.float16)
    assert "MoE: param_dtype" in str(err.value) and "x must" not in str(err.value)


def test_num_experts_must_split_over_the_mesh_at_construction():
    # Eager sharding under a mesh (experts over "ep" by the logical rules) ...
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("dp", "ep"))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mnn.logical_axis_rules(mesh.axis_names)):
        with pytest.raises(ValueError, match="num_experts=8 does not split over the "
                           "expert-parallel mesh axis 'ep' of size 3"):
            make_layer()
        make_layer(num_experts=6)  # 6 = 2 per device: fine
    # ... and an axis_name layer built under a mesh.
    with jax.set_mesh(mesh_of(2, 4)):
        with pytest.raises(ValueError, match="num_experts=6 does not split"):
            make_layer(num_experts=6, axis_name="ep", batch_axis_names=("dp", "ep"))


def test_wrong_hidden_size():
    with pytest.raises(ValueError, match="hidden_size"):
        make_layer()(jnp.ones((4, H + 1)))
    with pytest.raises(ValueError, match="hidden_size"):  # no last dimension at all
        make_layer()(jnp.float32(1.0))
    x = np.ones((2, H), np.float32)  # nested lists and numpy arrays are arrays too
    assert_bitwise(make_layer()(x.tolist())[0], make_layer()(jnp.asarray(x))[0], "list x")


@pytest.mark.parametrize("dtype", [None, jnp.float32, jnp.bfloat16])
def test_complex_tokens_are_refused(dtype):
    # Not cast to the computation dtype, which would drop the imaginary parts.
    x = tokens(4).astype(jnp.complex64)
    with pytest.raises(ValueError, match="MoE: x must be real"):
        make_layer(dtype=dtype)(x)


def test_router_kernel_of_another_shape_is_refused():
    # A router kernel replaced by one of another width would route to experts the
    # layer does not hold (ids past num_experts count as invalid pairs).
    layer = make_layer()
    layer.router.kernel = nnx.Param(jnp.zeros((H, E + 2)))
    with pytest.raises(ValueError, match=r"router.kernel has shape \(%d, %d\), expected" % (H, E + 2)):
        layer(jnp.ones((4, H)))


# --------------------------------------------------------------------------------------
# Routing and forward
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_fn, renormalize, route_scale", [
    ("softmax", False, 1.0), ("softmax", True, 1.0), ("sigmoid", True, 2.5)])
def test_routing_against_numpy(score_fn, renormalize, route_scale):
    layer = make_layer(score_fn=score_fn, renormalize=renormalize, route_scale=route_scale,
                       top_k=3)
    x = tokens(50)
    ids, weights, logits, probs = layer.route(x)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32 and logits.dtype == jnp.float32
    logits_np = np.asarray(x, np.float64) @ np.asarray(layer.router.kernel[...], np.float64)
    np.testing.assert_allclose(logits, logits_np, rtol=1e-5, atol=1e-5)
    scores = np_softmax(logits_np) if score_fn == "softmax" else 1 / (1 + np.exp(-logits_np))
    want_ids = np.argsort(-scores, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(ids, want_ids)
    w = np.take_along_axis(scores, want_ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(weights, w * route_scale, rtol=1e-5)
    np.testing.assert_allclose(probs, scores / scores.sum(axis=1, keepdims=True), rtol=1e-5)


def check_router_logits_accuracy(T=512, H=1024, E=32, seed=0):
    """`mnn.router_logits` against float64 for bfloat16 tokens and an f32 kernel,
    both ways, forward and backward: the logits and both gradients to f32
    accumulation error of the scale ``sum |a||b|`` (a kernel rounded to bf16
    would be off by ~2^-9 of it), the tokens' gradient then rounded to bf16. Shared with test_gpu.py, where
    XLA's GPU passes (excess precision) could undo the three-term split."""
    ks = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(ks[0], (T, H), jnp.float32).astype(BF16)
    w = jax.random.normal(ks[1], (H, E), jnp.float32) / np.sqrt(H)
    g = jax.random.normal(ks[2], (T, E), jnp.float32)
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    want = {"logits": (x64 @ w64, np.abs(x64) @ np.abs(w64)),
            "d kernel": (x64.T @ g64, np.abs(x64).T @ np.abs(g64))}
    dx_want = g64 @ w64.T
    # Jitted, as in a model (eagerly every op would compile alone, and XLA's
    # folding of f32 -> bf16 -> f32 round trips would never see the split).
    terms = jax.jit(lambda k: sum(t.astype(jnp.float32) for t in router._bf16_terms(k, 3)[::-1]))(w)
    assert_bitwise(terms, w, "the kernel's three bf16 terms sum to it")
    for router_dot in mnn.ROUTER_DOTS:
        logits, dx, dw = jax.jit(lambda a, b, c, d=router_dot: (
            lambda out, pullback: (out, *pullback(c)))(
                *jax.vjp(lambda u, v: mnn.router_logits(u, v, d), a, b)))(x, w, g)
        assert logits.dtype == jnp.float32 and dw.dtype == jnp.float32 and dx.dtype == BF16
        for what, got in (("logits", logits), ("d kernel", dw)):
            ref, scale = want[what]
            err = np.max(np.abs(np.asarray(got, np.float64) - ref) / scale)
            assert err < 2e-6, f"{router_dot}: {what} error {err:.3g} of the scale"
        dx_err = np.abs(np.asarray(dx, np.float64) - dx_want)
        bound = 2.0**-8 * np.abs(dx_want) + 2e-6 * (np.abs(g64) @ np.abs(w64).T)
        assert np.all(dx_err <= bound), f"{router_dot}: d tokens beyond bf16 rounding"


def test_router_logits_are_f32_accurate_both_ways():
    check_router_logits_accuracy()


def test_router_logits_use_bf16_products_only_for_bf16_tokens():
    w = jnp.ones((H, E), jnp.float32)

    def dots(x, router_dot):
        jaxpr = jax.make_jaxpr(lambda a, b: mnn.router_logits(a, b, router_dot))(x, w)
        found = []

        def walk(jp):
            for eqn in jp.eqns:
                if eqn.primitive.name == "dot_general":
                    found.append(tuple(v.aval.dtype for v in eqn.invars))
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    walk(sub)
        walk(jaxpr.jaxpr)
        return found

    assert dots(jnp.ones((4, H), BF16), "auto") == [(BF16, BF16)]
    assert dots(jnp.ones((4, H), BF16), "highest") == [(np.float32, np.float32)]
    assert dots(jnp.ones((4, H), jnp.float32), "auto") == [(np.float32, np.float32)]
    with pytest.raises(ValueError, match="router_dot must be one of"):
        mnn.router_logits(jnp.ones((4, H), BF16), w, "bf16")


@pytest.mark.slow
def test_router_dot_choices_route_alike():
    # The layer in bf16 with either router dot: the same experts, and weights,
    # outputs and router gradients equal to f32 rounding.
    x = tokens(128).astype(BF16)
    results = []
    for router_dot in mnn.ROUTER_DOTS:
        layer = make_layer(dtype=BF16, router_dot=router_dot)
        ids, weights, logits, _ = layer.route(x)

        def loss(layer):
            y, aux = layer(x)
            return jnp.sum(y.astype(jnp.float32) ** 2) + aux.aux_loss + aux.z_loss
        g = nnx.grad(loss)(layer)
        results.append((ids, weights, logits, g.router.kernel[...]))
    (ids0, w0, l0, g0), (ids1, w1, l1, g1) = results
    np.testing.assert_array_equal(ids0, ids1)
    np.testing.assert_allclose(l0, l1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(w0, w1, rtol=1e-5)
    assert_close(g0, g1, np.float32, what="d router kernel")


def test_top_k_matches_lax_top_k_with_ties():
    s = jax.random.normal(jax.random.key(0), (300, 16))
    s = s.at[:, 3].set(s[:, 5]).at[:7].set(0.0)  # ties inside rows and whole tied rows
    values, ids = jax.lax.top_k(s, 4)
    got_ids, got_values = router.top_k(s, s, 4)
    np.testing.assert_array_equal(got_ids, ids)
    assert_bitwise(got_values, values, "top-k values")


def test_top_k_matches_lax_top_k_with_infinities_and_nan():
    # Rows of -inf (an expert masked out, or the logits of a token holding inf)
    # must give k distinct experts in lax.top_k's order, never one twice.
    rng = np.random.default_rng(0)
    pool = np.array([-np.inf, np.inf, np.nan, -1.0, 0.0, 1.0], np.float32)
    s = jnp.asarray(rng.choice(pool, size=(4000, 16)))
    # Rows all -inf, all NaN, NaN but for two columns (XLA's CPU max over such rows
    # need not give NaN: nothing may rest on it), -inf but for a few.
    s = (s.at[0].set(-jnp.inf).at[1].set(jnp.nan).at[2, :12].set(-jnp.inf)
         .at[3:400].set(jnp.nan).at[3:400, 3].set(1.0).at[3:400, 9].set(-jnp.inf))
    for k in (1, 3, 16):
        values, ids = jax.lax.top_k(s, k)
        got_ids, got_values = router.top_k(s, 2.0 * s, k)
        np.testing.assert_array_equal(got_ids, ids, err_msg=f"k={k}")
        np.testing.assert_array_equal(got_values, 2.0 * values, err_msg=f"k={k}")
        assert all(len(set(row)) == k for row in np.asarray(got_ids).tolist())


@pytest.mark.parametrize("k", [0, 5])
def test_top_k_refuses_k_outside_the_experts(k):
    with pytest.raises(ValueError, match=f"top_k: k={k} must be in \\[1, 4\\]"):
        router.top_k(jnp.zeros((2, 4)), jnp.zeros((2, 4)), k)


@pytest.mark.parametrize("shape", [(3, 5, 5), (2, 3, 4, 6), (6,)])
def test_top_k_keeps_leading_dimensions(shape):
    # Any leading shape, as lax.top_k: each row of the last axis on its own (a
    # [B, T, E] with T == E must not mix rows of different tokens).
    # Ties in rows (+ 0.0: no -0.0, which argmax ties with 0.0 and lax.top_k does not).
    s = jnp.round(jax.random.normal(jax.random.key(4), shape) * 2) + 0.0
    for k in (1, 2, shape[-1]):
        values, ids = jax.lax.top_k(s, k)
        got_ids, got_values = router.top_k(s, 3.0 * s, k)
        assert got_ids.shape == ids.shape and got_ids.dtype == jnp.int32
        np.testing.assert_array_equal(got_ids, ids, err_msg=f"k={k}")
        np.testing.assert_array_equal(got_values, 3.0 * values, err_msg=f"k={k}")


def test_top_k_of_integer_scores_and_values():
    # Integer scores past 2^24 (no float32 holds both) keep their order, and
    # the values keep their dtype, as lax.top_k's.
    s = jnp.asarray([[2**24, 2**24 + 1, -(2**31), 7]], jnp.int32)
    values, ids = jax.lax.top_k(s, 4)
    got_ids, got_values = router.top_k(s, s, 4)
    np.testing.assert_array_equal(got_ids, ids)
    assert got_values.dtype == jnp.int32
    np.testing.assert_array_equal(got_values, values)


@pytest.mark.parametrize("select, values, k, match", [
    (jnp.zeros((2, 4)), jnp.zeros((1, 4)), 2, "values .* must have select's shape"),
    (jnp.zeros((2, 4)), jnp.zeros((2, 5)), 2, "values .* must have select's shape"),
    (jnp.zeros(()), jnp.zeros(()), 1, "at least one axis"),
    (jnp.zeros((2, 4)), jnp.zeros((2, 4)), 2.0, "k must be an int"),
    (jnp.zeros((2, 4)), jnp.zeros((2, 4)), True, "k must be an int"),
])
def test_top_k_refuses_bad_operands(select, values, k, match):
    with pytest.raises(ValueError, match=match):
        router.top_k(select, values, k)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.slow
def test_forward_is_moe_of_its_routing_plus_shared_expert(dtype):
    layer = make_layer(shared_ffn_size=12, dtype=dtype, renormalize=True)
    x = tokens(shape=(4, 6, H))
    y, aux = layer(x)
    assert y.shape == (4, 6, H) and y.dtype == dtype
    flat = x.reshape(-1, H)
    ids, weights, _, _ = layer.route(flat)
    xd = flat.astype(dtype)
    wgu, wd = layer.w_gate_up[...].astype(dtype), layer.w_down[...].astype(dtype)
    # The routed part is exactly mok_jax.moe on the layer's routing.
    routed = mok_jax.moe(xd, ids, weights, wgu, wd)
    shared = layer._shared_expert(xd)
    assert_bitwise(y.reshape(-1, H), routed + shared, "y = moe + shared")
    assert_close(routed, moe_reference(xd, ids, weights, wgu, wd), dtype,
                 what="routed vs reference")
    # The shared expert by hand (float64).
    xs = np.asarray(xd, np.float64)
    gu = xs @ np.asarray(layer.shared_gate_up[...].astype(dtype), np.float64)
    g, u = gu[:, :12], gu[:, 12:]
    hs = g / (1 + np.exp(-g)) * u
    want = hs @ np.asarray(layer.shared_down[...].astype(dtype), np.float64)
    assert_close(shared, want, dtype, f32_tol=1e-5, bf16_tol=2e-2, what="shared expert")
    assert int(aux.tokens_per_expert.sum()) == 24 * K and int(aux.dropped) == 0


def test_capacity_factor_reaches_moe():
    # A router that sends every token to experts 0 and then 1 (the tie among the
    # others breaks to the lowest index): capacity drops most pairs.
    layer = make_layer(capacity_factor=1.0)
    layer.router.kernel[...] = jnp.zeros((H, E)).at[:, 0].set(1.0)
    x = jnp.abs(tokens(64)) + 0.1
    y, aux = layer(x)
    cap = mok_jax.capacity(1.0, 64, K, E)
    np.testing.assert_array_equal(aux.tokens_per_expert, [64, 64, 0, 0, 0, 0, 0, 0])
    assert int(aux.dropped) == 2 * (64 - cap)
    assert np.all(np.isfinite(np.asarray(y)))


def test_numpy_capacity_factor_counts_as_its_value():
    # np.float32(0.1) is 0.100000001490116...: with T = 40, K = 2, E = 8 the limit
    # is c * 10 = 1.0000000149..., so ceil keeps 2 rows. Multiplied out in float32
    # the product rounds to 1.0 and would keep 1.
    c = np.float32(0.1)
    assert mok_jax.capacity(c, 40, K, E) == mok_jax.capacity(float(c), 40, K, E) == 2
    x = tokens(40)
    y32, aux32 = make_layer(capacity_factor=c)(x)
    y64, aux64 = make_layer(capacity_factor=float(c))(x)
    over_two = np.maximum(np.asarray(aux32.tokens_per_expert) - 2, 0).sum()
    assert int(aux32.dropped) == int(aux64.dropped) == over_two > 0
    assert_bitwise(y32, y64, "np.float32 and float capacity_factor")


# --------------------------------------------------------------------------------------
# Auxiliary losses
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_aux_losses_against_hand_computation(score_fn):
    layer = make_layer(score_fn=score_fn, top_k=3)
    x = tokens(40, seed=7)
    _, aux = layer(x)
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router.kernel[...], np.float64)
    scores = np_softmax(logits) if score_fn == "softmax" else 1 / (1 + np.exp(-logits))
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :3]
    counts = np.bincount(ids.ravel(), minlength=E)
    f = counts / (40 * 3)                                         # fraction of routed pairs
    p = (scores / scores.sum(axis=1, keepdims=True)).mean(axis=0)  # mean router probability
    np.testing.assert_array_equal(aux.tokens_per_expert, counts)
    np.testing.assert_allclose(float(aux.aux_loss), E * np.sum(f * p), rtol=1e-5)
    lse = np.log(np.exp(logits).sum(axis=1))
    np.testing.assert_allclose(float(aux.z_loss), np.mean(lse ** 2), rtol=1e-5)


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_routing_far_in_the_tails_follows_the_logits(score_fn):
    """Logits from -130 up to -104 (the last expert's the largest), where every
    sigmoid underflows to 0: the picks are still the top logits (not the lowest
    indices of equal scores), the renormalized weights s_i / sum(s) (for
    sigmoids: the softmax of the picked log-sigmoids) are finite and right, and so
    are y and the aux loss."""
    layer = make_layer(score_fn=score_fn, renormalize=True, top_k=3)
    per_expert = -(130.0 - 3.75 * np.arange(E))  # expert e's logit for a token of ones
    layer.router.kernel[...] = jnp.asarray(np.tile(per_expert / H, (H, 1)), jnp.float32)
    x = jnp.ones((2, H), jnp.float32).at[1].multiply(1.1)
    ids, w, logits, probs = layer.route(x)
    logits64 = np.asarray(logits, np.float64)
    want_ids = np.argsort(-logits64, axis=1, kind="stable")[:, :3]
    assert np.all(want_ids[:, 0] == E - 1)
    np.testing.assert_array_equal(ids, want_ids)
    picked = np.take_along_axis(logits64, want_ids, 1)
    log_s = -np.logaddexp(0.0, -picked)
    np.testing.assert_allclose(w, np_softmax(log_s if score_fn == "sigmoid" else picked),
                               rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(probs)))
    y, aux = layer(x)
    assert np.all(np.isfinite(np.asarray(y))) and np.isfinite(float(aux.aux_loss))


def test_aux_loss_is_one_when_balanced_and_e_when_collapsed():
    layer = make_layer(top_k=1)
    # Zero router: uniform probabilities; top-1 ties break to expert 0 (collapse) ...
    layer.router.kernel[...] = jnp.zeros((H, E))
    _, aux = layer(tokens(32))
    np.testing.assert_allclose(float(aux.aux_loss), 1.0, rtol=1e-6)   # p uniform: E * 1 * 1/E
    # ... a router that puts all probability and all tokens on expert 2: E.
    layer.router.kernel[...] = jnp.zeros((H, E)).at[:, 2].set(100.0)
    _, aux = layer(jnp.ones((32, H)))
    np.testing.assert_allclose(float(aux.aux_loss), E, rtol=1e-6)
    np.testing.assert_allclose(float(aux.z_loss), (100.0 * H) ** 2, rtol=1e-6)


# --------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_grads_against_reference_layer(monkeypatch):
    layer = make_layer(shared_ffn_size=8, renormalize=True)
    x = tokens(48, seed=3)

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.mean(y ** 2) + 0.1 * aux.aux_loss + 0.01 * aux.z_loss

    grads = nnx.grad(loss)(layer, x)

    # The same layer with mok_jax.moe replaced by the pure-JAX reference.
    def reference_moe(*args, return_stats=False, axis_name=None, backend=None, check_mesh=True,
                      **kw):
        return moe_reference(*args, return_stats=return_stats, **kw)

    monkeypatch.setattr(mnn.mok_jax, "moe", reference_moe)
    grads_ref = nnx.grad(loss)(layer, x)
    flat, flat_ref = nnx.to_flat_state(grads), nnx.to_flat_state(grads_ref)
    assert [k for k, _ in flat] == [k for k, _ in flat_ref]
    assert len(flat) == 5  # router, experts (2), shared expert (2)
    for (path, g), (_, g_ref) in zip(flat, flat_ref):
        g, g_ref = np.asarray(g[...]), np.asarray(g_ref[...])
        assert np.any(g != 0), f"zero gradient for {path}"
        assert_close(g, g_ref, np.float32, f32_tol=1e-4, what=f"d{'/'.join(map(str, path))}")


def test_router_gets_gradient_from_aux_losses_alone():
    layer = make_layer()
    x = tokens(32)
    g = nnx.grad(lambda m: m(x)[1].aux_loss)(layer)
    assert np.any(np.asarray(g.router.kernel[...]) != 0)
    assert not np.any(np.asarray(g.w_gate_up[...]))  # experts do not see the aux loss


def test_jit_grad_is_deterministic():
    layer = make_layer()
    x = tokens(64)
    step = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))
    a, b = step(layer, x), step(layer, x)
    for (_, u), (_, v) in zip(nnx.to_flat_state(a), nnx.to_flat_state(b)):
        assert_bitwise(u[...], v[...], "repeated grad")


# --------------------------------------------------------------------------------------
# Bias-based balancing (DeepSeek-V3)
# --------------------------------------------------------------------------------------


def test_update_balance_bias_is_sign_based():
    layer = make_layer(balance_bias=True)
    counts = jnp.array([10, 2, 4, 4, 0, 4, 8, 0], jnp.int32)           # mean 4
    layer.update_balance_bias(counts, 0.5)
    np.testing.assert_array_equal(layer.balance_bias[...], [-0.5, 0.5, 0, 0, 0.5, 0, -0.5, 0.5])
    nnx.jit(lambda m, c: m.update_balance_bias(c, 0.25))(layer, counts)  # and under jit
    np.testing.assert_array_equal(layer.balance_bias[...],
                                  [-0.75, 0.75, 0, 0, 0.75, 0, -0.75, 0.75])
    with pytest.raises(ValueError, match="shape"):
        layer.update_balance_bias(jnp.ones(3), 0.1)
    with pytest.raises(ValueError, match="balance_bias=False"):
        make_layer().update_balance_bias(counts, 0.1)
    with pytest.raises(ValueError, match=r"rate must be a scalar or have shape \[E\] = \(8,\), "
                                         r"got \(3,\)"):
        make_layer(balance_bias=True).update_balance_bias(counts, jnp.ones(3))
    per_expert = make_layer(balance_bias=True)  # a rate per expert
    per_expert.update_balance_bias(counts, jnp.arange(E, dtype=jnp.float32))
    np.testing.assert_array_equal(per_expert.balance_bias[...], [0, 1, 0, 0, 4, 0, -6, 7])


@pytest.mark.parametrize("counts, rate, match", [
    (None, -0.5, "rate must be finite and >= 0"),
    (None, float("nan"), "rate must be finite and >= 0"),
    (None, float("inf"), "rate must be finite and >= 0"),
    (None, np.float32(-1e-3), "rate must be finite and >= 0"),
    (None, jnp.array(-1e-3), "rate must be finite and >= 0"),
    (None, jnp.arange(E, dtype=jnp.float32) - 1, "rate must be finite and >= 0"),
    (None, "0.1", "rate must be a real number"),
    (None, 1j, "rate must be a real number"),
    (None, None, "rate must be a real number"),
    (None, True, "rate must be a real number"),
    ("abc", 0.1, "tokens_per_expert must be real counts"),
    (jnp.ones(E, jnp.complex64), 0.1, "tokens_per_expert must be real counts"),
])
def test_update_balance_bias_refuses_bad_rates_and_counts(counts, rate, match):
    layer = make_layer(balance_bias=True)
    counts = jnp.array([10, 2, 4, 4, 0, 4, 8, 0], jnp.int32) if counts is None else counts
    with pytest.raises(ValueError, match="MoE.update_balance_bias: " + match):
        layer.update_balance_bias(counts, rate)
    np.testing.assert_array_equal(layer.balance_bias[...], np.zeros(E))


def test_update_balance_bias_takes_a_traced_rate_under_jit():
    layer = make_layer(balance_bias=True)
    counts = jnp.array([10, 2, 4, 4, 0, 4, 8, 0], jnp.int32)
    nnx.jit(lambda m, c, r: m.update_balance_bias(c, r))(layer, counts, jnp.float32(0.5))
    np.testing.assert_array_equal(layer.balance_bias[...], [-0.5, 0.5, 0, 0, 0.5, 0, -0.5, 0.5])


def test_balance_bias_selects_but_does_not_weight():
    layer = make_layer(balance_bias=True, renormalize=False)
    x = tokens(64)
    ids0, w0, _, _ = layer.route(x)
    layer.balance_bias[...] = jnp.zeros(E).at[5].set(10.0)  # expert 5 always selected
    ids, w, _, probs = layer.route(x)
    assert np.all(np.asarray(ids)[:, 0] == 5)
    assert not np.array_equal(ids, ids0)
    # Weights (and probs) are the unbiased scores of the selected experts, from numpy.
    scores = np_softmax(np.asarray(x, np.float64)
                        @ np.asarray(layer.router.kernel[...], np.float64))
    np.testing.assert_allclose(w, np.take_along_axis(scores, np.asarray(ids), 1), rtol=1e-5)
    np.testing.assert_allclose(probs, scores, rtol=1e-5)


def test_renormalized_weights_stay_finite_where_the_bias_picks_underflowed_scores():
    """A balance bias can pick experts whose softmax scores underflow to 0 (a logit
    gap above about 104): renormalized, their weights are the softmax of their
    logits (s_i / sum(s) in exact arithmetic), not 0 / 0, and y and the gradients
    stay finite."""
    layer = make_layer(renormalize=True, balance_bias=True)
    layer.router.kernel[...] = jnp.zeros((H, E)).at[:, 0].set(7.0)  # logit 112 on expert 0
    layer.balance_bias[...] = jnp.zeros(E).at[0].set(-2.0)  # which the bias pushes out
    x = jnp.ones((4, H), jnp.float32)
    ids, w, logits, _ = layer.route(x)
    assert not np.any(np.asarray(ids) == 0)
    picked = np.take_along_axis(np.asarray(logits, np.float64), np.asarray(ids), 1)
    np.testing.assert_allclose(w, np_softmax(picked), rtol=1e-6)
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(layer)
    for path, g in nnx.to_flat_state(grads):
        assert np.all(np.isfinite(np.asarray(g[...]))), path


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_renormalized_top_1_gives_the_router_no_gradient_from_the_output(score_fn):
    # Every weight is exactly 1, a constant: the router's gradient from y is 0,
    # not rounding noise (which Adam would scale up to full steps).
    layer = make_layer(top_k=1, renormalize=True, score_fn=score_fn)
    x = tokens(64)
    _, w, _, _ = layer.route(x)
    assert np.all(np.asarray(w) == 1.0)
    grads = nnx.grad(lambda m: jnp.mean(m(x)[0] ** 2))(layer)
    assert np.all(np.asarray(grads.router.kernel[...]) == 0.0)
    assert np.any(np.asarray(grads.w_down[...]) != 0.0)


def test_balance_bias_updates_balance_a_skewed_router():
    layer = make_layer(balance_bias=True, top_k=1, score_fn="sigmoid")
    layer.router.kernel[...] = layer.router.kernel[...].at[:, 0].add(0.3)  # favour expert 0
    x = tokens(512, seed=11) + 0.5

    @nnx.jit
    def step(layer, x):
        _, aux = layer(x)
        layer.update_balance_bias(aux.tokens_per_expert, 0.01)
        return aux.tokens_per_expert

    first = np.asarray(step(layer, x))
    for _ in range(40):
        last = np.asarray(step(layer, x))
    imbalance = lambda c: c.max() / c.mean()  # noqa: E731
    assert imbalance(first) > 4.0, first
    assert imbalance(last) < 1.4, (first, last)
    assert float(layer.balance_bias[0]) < 0  # the favoured expert was pushed down


# --------------------------------------------------------------------------------------
# Sharding: metadata, jit on meshes, shard_map
# --------------------------------------------------------------------------------------


def test_logical_axis_rules_and_named_shardings():
    assert dict(mnn.logical_axis_rules(("dp", "ep")))["batch"] == ("dp", "ep")
    assert dict(mnn.logical_axis_rules(("dp", "ep")))["expert"] == "ep"
    assert dict(mnn.logical_axis_rules(("dp",)))["expert"] is None
    assert dict(mnn.logical_axis_rules(("data",)))["batch"] is None
    layer = make_layer(shared_ffn_size=8, balance_bias=True)
    state = nnx.state(layer)
    for (dp, ep), expert_spec in (((4, 2), P("ep", None, None)), ((8, 1), P("ep", None, None))):
        sh = mnn.named_shardings(state, mesh_of(dp, ep))
        assert sh["w_gate_up"].get_value().spec == expert_spec
        assert sh["w_down"].get_value().spec == expert_spec
        assert sh["router"]["kernel"].get_value().spec == P(None, None)
        assert sh["shared_gate_up"].get_value().spec == P(None, None)
        assert sh["balance_bias"].get_value().spec == P()
    dp_only = jax.sharding.Mesh(np.array(jax.devices()), ("dp",))
    assert mnn.named_shardings(state, dp_only)["w_gate_up"].get_value().spec == P(None, None, None)


def test_logical_axis_rules_refuse_a_string_for_a_sequence_of_names():
    # A str is a sequence of one-letter names: "ep" would match neither axis and
    # leave the tokens or the experts replicated.
    with pytest.raises(ValueError, match="logical_axis_rules: data_axes must be a sequence"):
        mnn.logical_axis_rules(("dp", "ep"), data_axes="ep")
    with pytest.raises(ValueError, match="logical_axis_rules: mesh_axis_names must be a seq"):
        mnn.logical_axis_rules("ep")
    assert dict(mnn.logical_axis_rules(["dp", "ep"], data_axes=["ep"]))["batch"] == ("ep",)


def test_eager_sharding_under_a_mesh():
    mesh = mesh_of(4, 2)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(mnn.logical_axis_rules(mesh.axis_names)):
        layer = make_layer()
    assert layer.w_gate_up[...].sharding.spec == P("ep", None, None)
    assert layer.w_gate_up[...].sharding.mesh.shape == {"dp": 4, "ep": 2}
    assert layer.router.kernel[...].sharding.is_fully_replicated


def _loss_and_grads(layer, x):
    def loss(layer, x):
        y, aux = layer(x)
        return jnp.mean(y ** 2) + 0.01 * aux.aux_loss + 1e-3 * aux.z_loss, (y, aux)

    return nnx.value_and_grad(loss, has_aux=True)(layer, x)


def _place(layer, x, mesh):
    graphdef, state = nnx.split(layer)
    state = jax.device_put(state, mnn.named_shardings(state, mesh))
    return nnx.merge(graphdef, state), jax.device_put(x, NamedSharding(mesh, P(("dp", "ep"))))


def assert_layer_output(y, y0, shared_ffn_size, what):
    """The routed experts' output keeps its bits on any mesh; a shared expert is
    XLA's dots, whose bits may depend on the rows per device (jax 0.12's CPU dot
    does), so with one y agrees to f32 rounding."""
    if shared_ffn_size:
        assert_close(y, y0, np.float32, f32_tol=1e-6, what=what)
    else:
        assert_bitwise(y, y0, what)


@pytest.mark.parametrize("axis_type", [AxisType.Auto,
                                       pytest.param(AxisType.Explicit, marks=pytest.mark.slow)])
@pytest.mark.parametrize("shared_ffn_size", [0, 8])
@pytest.mark.parametrize("dp, ep", [(8, 1), (4, 2)])
def test_jit_on_a_mesh_matches_one_device(dp, ep, shared_ffn_size, axis_type):
    # Data parallel (experts replicated, ep=1) and experts sharded over ep, on Auto
    # and on Explicit axes (jax.make_mesh's default, whose types carry the tokens'
    # sharding through the router's top-k).
    layer = make_layer(shared_ffn_size=shared_ffn_size)
    x = tokens(64)
    (loss0, (y0, aux0)), g0 = nnx.jit(_loss_and_grads)(layer, x)
    mesh = mesh_of(dp, ep, axis_type)
    with jax.set_mesh(mesh):
        sharded_layer, xs = _place(layer, x, mesh)
        assert sharded_layer.w_gate_up[...].sharding.spec == P("ep", None, None)
        (loss, (y, aux)), g = nnx.jit(_loss_and_grads)(sharded_layer, xs)
    assert y.sharding.spec[0] in (("dp", "ep"), "dp")
    assert_layer_output(y, y0, shared_ffn_size, f"y on mesh ({dp},{ep})")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
    np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-6)
    for (path, a), (_, b) in zip(nnx.to_flat_state(g), nnx.to_flat_state(g0)):
        assert_close(a[...], b[...], np.float32, f32_tol=1e-5, what=f"d{path} on ({dp},{ep})")


@pytest.mark.slow
def test_jit_outputs_bitwise_across_expert_placements():
    # The same token sharding, experts replicated vs sharded over ep: the layer's
    # output and the loss are the same bits. The router's weight gradient is XLA's
    # sum over the token shards: the same bits whenever the experts are split
    # (the same partitioned program around the layer); with replicated experts
    # the layer runs per device without the ids' all-gather, XLA partitions the
    # router's backward differently, and the sum's association (its last bits)
    # may differ.
    layer = make_layer()
    x = tokens(64)
    results = []
    for dp, ep in ((8, 1), (4, 2), (2, 4)):
        mesh = mesh_of(dp, ep)
        with jax.set_mesh(mesh):
            sharded_layer, xs = _place(layer, x, mesh)
            (loss, (y, aux)), g = nnx.jit(_loss_and_grads)(sharded_layer, xs)
        results.append((y, loss, g.router.kernel[...]))
    for (y, loss, g_router), ep in zip(results[1:], (2, 4)):
        assert_bitwise(y, results[0][0], f"y ep={ep}")
        assert_bitwise(loss, results[0][1], f"loss ep={ep}")
        np.testing.assert_allclose(g_router, results[0][2], rtol=1e-6, atol=1e-9,
                                   err_msg=f"d router ep={ep}")
    assert_bitwise(results[2][2], results[1][2], "d router, ep=4 vs ep=2")


def _shard_map_layer_step(layer, x, mesh):
    graphdef, state = nnx.split(layer)
    specs = jax.tree.map(lambda s: s.spec, mnn.named_shardings(state, mesh),
                         is_leaf=lambda a: isinstance(a, NamedSharding))

    def local(state, x):
        y, aux = nnx.merge(graphdef, state)(x)
        return y, aux

    f = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(("dp", "ep"))),
                      out_specs=(P(("dp", "ep")), mnn.MoEAux(P(), P(), P(), P())),
                      check_vma=True)
    return jax.jit(f)(state, x)


@pytest.mark.parametrize("shared_ffn_size", [0, 8])
@pytest.mark.parametrize("dp, ep", [(8, 1), (2, 4)])
def test_inside_shard_map_matches_jit(dp, ep, shared_ffn_size):
    layer = make_layer(shared_ffn_size=shared_ffn_size)
    x = tokens(64)
    y0, aux0 = jax.jit(lambda x: layer(x))(x)
    sm_layer = make_layer(shared_ffn_size=shared_ffn_size, axis_name="ep",
                          batch_axis_names=("dp", "ep"))
    y, aux = _shard_map_layer_step(sm_layer, x, mesh_of(dp, ep))
    assert_layer_output(y, y0, shared_ffn_size, f"y inside shard_map ({dp},{ep})")
    np.testing.assert_array_equal(aux.tokens_per_expert, aux0.tokens_per_expert)
    assert int(aux.dropped) == int(aux0.dropped) == 0
    # Global aux values: means of shard means (same value, other summation order).
    np.testing.assert_allclose(float(aux.aux_loss), float(aux0.aux_loss), rtol=1e-6)
    np.testing.assert_allclose(float(aux.z_loss), float(aux0.z_loss), rtol=1e-6)


def test_batch_axis_not_splitting_the_tokens_is_an_error():
    """Tokens split over ep only, but batch_axis_names also names dp: the layer would
    add up its statistics over two copies of the same tokens. It says so (it was
    JAX's message about psum and varying axes)."""
    mesh = mesh_of(2, 2)
    layer = make_layer(axis_name="ep", batch_axis_names=("dp", "ep"))
    graphdef, state = nnx.split(layer)
    specs = jax.tree.map(lambda s: s.spec, mnn.named_shardings(state, mesh),
                         is_leaf=lambda a: isinstance(a, NamedSharding))
    f = jax.shard_map(lambda state, x: nnx.merge(graphdef, state)(x), mesh=mesh,
                      in_specs=(specs, P("ep")),
                      out_specs=(P("ep"), mnn.MoEAux(P(), P(), P(), P())), check_vma=True)
    with pytest.raises(ValueError, match=r"includes \('dp',\), but x is not split over it "
                                         r"\(it varies over \('ep',\) only\)"):
        jax.jit(f)(state, tokens(64))
    # Tokens replicated over both axes, experts replicated too (no EP): both named
    # axes are missing.
    dp_layer = make_layer(batch_axis_names=("dp", "ep"))
    graphdef, state = nnx.split(dp_layer)
    f = jax.shard_map(lambda state, x: nnx.merge(graphdef, state)(x), mesh=mesh,
                      in_specs=(P(), P()), out_specs=(P(), mnn.MoEAux(P(), P(), P(), P())),
                      check_vma=True)
    with pytest.raises(ValueError, match=r"includes \('dp', 'ep'\), but x is not split "
                                         r"over them \(it varies over \(\) only\)"):
        jax.jit(f)(state, tokens(64))
    # With check_vma=False JAX tracks nothing: the layer cannot tell, and runs.
    f = jax.shard_map(lambda state, x: nnx.merge(graphdef, state)(x), mesh=mesh,
                      in_specs=(P(), P()), out_specs=(P(), mnn.MoEAux(P(), P(), P(), P())),
                      check_vma=False)
    assert jax.jit(f)(state, tokens(64))[0].shape == (64, H)
    # The same tokens split over both axes run.
    y, aux = _shard_map_layer_step(layer, tokens(64), mesh)
    assert y.shape == (64, H) and int(np.sum(aux.tokens_per_expert)) == 64 * K


@pytest.mark.parametrize("dp, ep", [pytest.param(8, 1, marks=pytest.mark.slow), (2, 4)])
@pytest.mark.slow
def test_bf16_gradients_inside_shard_map_match_jit(dp, ep):
    # The bf16 router's custom VJP inside shard_map (check_vma): its kernel is
    # replicated, the tokens vary over (dp, ep); the kernel's gradient is summed.
    x = tokens(64).astype(BF16)

    def loss(layer, x, total):
        y, aux = layer(x)
        return total(jnp.sum(y.astype(jnp.float32) ** 2)) + aux.aux_loss + aux.z_loss

    want = nnx.grad(loss)(make_layer(dtype=BF16), x, lambda v: v)
    layer = make_layer(dtype=BF16, axis_name="ep", batch_axis_names=("dp", "ep"))
    mesh = mesh_of(dp, ep)
    graphdef, state = nnx.split(layer)
    specs = jax.tree.map(lambda s: s.spec, mnn.named_shardings(state, mesh),
                         is_leaf=lambda a: isinstance(a, NamedSharding))

    def local(state, x):
        total = lambda v: jax.lax.psum(v, ("dp", "ep"))  # noqa: E731
        return jax.grad(lambda st: loss(nnx.merge(graphdef, st), x, total))(state)

    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P(("dp", "ep"))),
                                out_specs=specs, check_vma=True))(state, x)
    # f32: the partial sums over each device's tokens, then psum, against one sum.
    assert_close(got["router"]["kernel"][...], want.router.kernel[...], np.float32,
                 what="d router kernel")
    for name in ("w_gate_up", "w_down"):
        assert_close(got[name][...], getattr(want, name)[...], BF16, what=f"d {name}")


@pytest.mark.parametrize("router_dot", mnn.ROUTER_DOTS)
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
@pytest.mark.parametrize("x_shape, w_shape, match", [
    ((), (H, E), "tokens must have at least one axis"),   # jnp.dot would scale the kernel
    ((4, H), (H,), "kernel must be \\[H, E\\]"),
    ((4, H), (H, E, 2), "kernel must be \\[H, E\\]"),
    ((4, H + 1), (H, E), "tokens' last dimension"),
])
def test_router_logits_refuse_bad_shapes(router_dot, dtype, x_shape, w_shape, match):
    with pytest.raises(ValueError, match=match):
        mnn.router_logits(jnp.ones(x_shape, dtype), jnp.ones(w_shape, jnp.float32), router_dot)


def test_router_logits_keep_leading_dimensions():
    x = tokens(24).astype(BF16).reshape(2, 12, H)
    w = jax.random.normal(jax.random.key(3), (H, E), jnp.float32)
    got = mnn.router_logits(x, w)
    assert got.shape == (2, 12, E)
    np.testing.assert_allclose(got, mnn.router_logits(x, w, "highest"), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.reshape(24, E), mnn.router_logits(x.reshape(24, H), w),
                               rtol=0, atol=0)


@pytest.mark.parametrize("shape, spec, kernel_spec", [
    ((64, H), P("dp", None), P()), ((4, 16, H), P(None, "dp", None), P()),
    ((4, 16, H), P("dp", "ep", None), P()), ((64, H), P("dp", None), P(None, "ep")),
    ((4, 16, H), P(None, "dp", None), P(None, "ep"))])  # (tokens and E both over ep: the
@pytest.mark.parametrize("in_context", [True, False])  # logits' type is illegal in JAX)
def test_router_logits_gradients_on_an_explicit_mesh(shape, spec, kernel_spec, in_context):
    # jax.make_mesh gives Explicit axes: there the backward's tokens^T @ d_logits
    # contracts the sharded token dimensions and must name its result's sharding
    # (it raised ShardingTypeError), reshaping tokens sharded on their second
    # dimension is not expressible, and with the kernel's E sharded d tokens
    # contracts a sharded 6E. With or without `jax.set_mesh` (then the mesh comes
    # from the arrays' types). Both dots must agree with the f32 one.
    mesh = jax.make_mesh((4, 2), ("dp", "ep"), axis_types=(AxisType.Explicit,) * 2)
    x = jax.random.normal(jax.random.key(5), shape, jnp.float32).astype(BF16)
    w = jax.random.normal(jax.random.key(6), (H, E), jnp.float32)

    def loss(x, w, router_dot):
        return jnp.sum(jnp.sin(mnn.router_logits(x, w, router_dot)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    ws = jax.device_put(w, NamedSharding(mesh, kernel_spec))
    with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
        dx, dw = grad(xs, ws, "auto")
        dx_ref, dw_ref = grad(xs, ws, "highest")
    assert dx.sharding.is_equivalent_to(xs.sharding, dx.ndim)
    assert dw.sharding.is_equivalent_to(ws.sharding, dw.ndim)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-4)
    assert_close(dx, dx_ref, BF16, what="d tokens")
    # And the values without a mesh: the same bits for d tokens unless its
    # contraction (over the kernel's E) was split over devices and summed.
    dx0, dw0 = grad(x, w, "auto")
    np.testing.assert_allclose(dw, dw0, rtol=1e-6, atol=1e-5)
    if kernel_spec == P():
        np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx0, np.float32))
    else:
        assert_close(dx, dx0, BF16, what="d tokens, E sharded")


def _trace_in_shard_map(layer, mesh, param_specs):
    """Traces the layer inside shard_map (nothing runs) with the given parameter specs."""
    graphdef, state = nnx.split(layer)
    specs = param_specs(state, mesh)
    f = jax.shard_map(lambda s, x: nnx.merge(graphdef, s)(x)[0], mesh=mesh,
                      in_specs=(specs, P(("dp", "ep"))), out_specs=P(("dp", "ep")))
    return jax.eval_shape(f, state, jax.ShapeDtypeStruct((64, H), jnp.float32))


def _logical_specs(state, mesh):
    return jax.tree.map(lambda s: s.spec, mnn.named_shardings(state, mesh),
                        is_leaf=lambda a: isinstance(a, NamedSharding))


def _replicated_specs(state, mesh):
    return jax.tree.map(lambda _: P(), state)


def test_shard_map_with_unsharded_experts_names_the_ep_mismatch():
    # Every device holds all 8 experts while the EP axis has 4 devices: 8 x 4 != 8.
    # This used to fail deep inside with "mul got incompatible shapes (32,), (8,)".
    layer = make_layer(axis_name="ep", batch_axis_names=("dp", "ep"))
    with pytest.raises(ValueError, match=r"local experts x EP axis size must equal num_experts, "
                       r"got 8 local experts .* x 4 \(mesh axis 'ep'\) = 32 != num_experts=8; "
                       r"each device must hold num_experts / 4 = 2 experts"):
        _trace_in_shard_map(layer, mesh_of(2, 4), _replicated_specs)
    # The right placement traces.
    out = _trace_in_shard_map(layer, mesh_of(2, 4), _logical_specs)
    assert out.shape == (64, H)


def test_shard_map_with_sharded_experts_but_no_axis_name():
    # Without axis_name the layer would treat its 2 local experts as all of them
    # (ids 2..7 silently invalid): refused, naming axis_name.
    layer = make_layer(batch_axis_names=("dp", "ep"))
    with pytest.raises(ValueError, match=r"holds 2 experts .* but num_experts=8.*axis_name"):
        _trace_in_shard_map(layer, mesh_of(2, 4), _logical_specs)


def test_unbound_axis_names_at_call():
    layer = make_layer(axis_name="ep", batch_axis_names=("dp", "ep"))
    with pytest.raises(ValueError, match="axis_name='ep' is not a bound mesh axis"):
        layer(tokens(8))
    layer = make_layer(batch_axis_names=("tp",))
    with pytest.raises(ValueError, match="batch_axis_names names 'tp', which is not a bound"):
        _trace_in_shard_map(layer, mesh_of(2, 4), _replicated_specs)


def test_import_mok_jax_exposes_nn_and_reference_lazily():
    # A fresh interpreter: `import mok_jax` alone gives mok_jax.nn and
    # mok_jax.reference; flax is imported only when mok_jax.nn is first touched.
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import mok_jax
        assert "flax" not in sys.modules and "mok_jax.nn" not in sys.modules
        assert {"nn", "reference", "moe", "MoEStats"} <= set(mok_jax.__all__)
        assert {"nn", "reference"} <= set(dir(mok_jax))
        assert callable(mok_jax.reference.moe_reference)
        layer_cls = mok_jax.nn.MoE
        assert "flax" in sys.modules and layer_cls.__module__ == "mok_jax.nn"
        import mok_jax.nn
        from mok_jax import nn
        assert nn is mok_jax.nn and nn.MoE is layer_cls
        try:
            mok_jax.no_such_thing
        except AttributeError as err:
            assert "no_such_thing" in str(err)
        else:
            raise AssertionError("mok_jax.no_such_thing did not raise")
        print("ok")
    """)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(mok_jax.__file__)))
    env = script_env()
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120, cwd=os.path.dirname(package_root))
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.slow
def test_check_mesh_is_validated_and_passed_to_moe(monkeypatch):
    from flax import nnx
    with pytest.raises(ValueError, match="check_mesh must be a bool"):
        mok_jax.nn.MoE(hidden_size=8, ffn_size=4, num_experts=4, top_k=2, check_mesh="no",
                       rngs=nnx.Rngs(0))
    layer = mok_jax.nn.MoE(hidden_size=8, ffn_size=4, num_experts=4, top_k=2,
                           check_mesh=False, rngs=nnx.Rngs(0))
    seen = {}
    real = mok_jax.moe

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(mok_jax, "moe", spy)
    y, _ = layer(jnp.ones((3, 8)))
    assert seen["check_mesh"] is False and y.shape == (3, 8)


@pytest.mark.parametrize("shape", [(0, H), (3, 0, H)])
def test_a_call_with_no_tokens_has_zero_losses_and_gradients(shape):
    """No tokens: an empty y, no routed pairs, and aux and z losses of 0 (not the NaN
    of a mean over nothing, which would poison a training loss), with zero
    gradients."""
    layer = make_layer(capacity_factor=1.0)
    x = jnp.zeros(shape, jnp.float32)
    y, aux = layer(x)
    assert y.shape == shape
    assert float(aux.aux_loss) == 0.0 and float(aux.z_loss) == 0.0
    assert not np.any(np.asarray(aux.tokens_per_expert)) and int(aux.dropped) == 0

    def loss(layer, x):
        y, aux = layer(x)
        return jnp.sum(y) + aux.aux_loss + aux.z_loss

    grads = nnx.grad(loss)(layer, x)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.asarray(leaf) == 0), leaf
