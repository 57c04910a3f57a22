"""Pure-JAX MoE pipelines that `mok_jax.moe` is measured against.

Each pipeline has the signature of `mok_jax.moe` without its keyword options::

    y = pipeline(x, expert_ids, expert_weights, w_gate_up, w_down)

| argument | shape | dtype |
| --- | --- | --- |
| `x` | `[T, H]` | bf16 or f32 |
| `expert_ids` | `[T, K]`, expert ids in `[0, E)` | int32 |
| `expert_weights` | `[T, K]` | f32 or x.dtype |
| `w_gate_up` | `[E, H, 2F]`: columns `[0, F)` gate, `[F, 2F)` up | x.dtype |
| `w_down` | `[E, F, H]` | x.dtype |

and returns `y` `[T, H]` in x.dtype with
`y[t] = sum_k expert_weights[t, k] * FFN_{expert_ids[t, k]}(x[t])`,
`FFN_e(v) = (silu(v @ Wg_e) * (v @ Wu_e)) @ Wd_e`. They follow the numerics of
the contract in docs/contract.md (f32 accumulation, `h` rounded to x.dtype, expert outputs rounded to
x.dtype, combine in f32), so they agree with `mok_jax.reference.moe_reference` to
rounding. They are written the way a JAX user writes them today, not tuned; they are
differentiable with respect to `x`, `expert_weights`, `w_gate_up` and `w_down`.

An expert id outside `[0, E)` contributes 0, as in `mok_jax.moe`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = [
    "ragged_dot_moe",
    "dense_onehot_moe",
    "tokamax_moe",
    "tokamax_available",
]

RaggedDot = Callable[..., jax.Array]


def _check_shapes(x, expert_ids, expert_weights, w_gate_up, w_down):
    """Returns (T, H, K, E, F) after checking that the operands agree."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, H], got shape {x.shape}")
    t, h = x.shape
    if expert_ids.ndim != 2 or expert_ids.shape[0] != t:
        raise ValueError(
            f"expert_ids must be [T={t}, K], got shape {expert_ids.shape}")
    k = expert_ids.shape[1]
    if expert_weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_weights must have the shape of expert_ids {expert_ids.shape},"
            f" got {expert_weights.shape}")
    if w_gate_up.ndim != 3 or w_gate_up.shape[1] != h or w_gate_up.shape[2] % 2:
        raise ValueError(
            f"w_gate_up must be [E, H={h}, 2F], got shape {w_gate_up.shape}")
    e, _, f2 = w_gate_up.shape
    f = f2 // 2
    if w_down.shape != (e, f, h):
        raise ValueError(
            f"w_down must be [E={e}, F={f}, H={h}], got shape {w_down.shape}")
    return t, h, k, e, f


def _swiglu(gate_up: jax.Array, f: int, dtype) -> jax.Array:
    """[N, 2F] f32 accumulators -> silu(gate) * up in f32, rounded to dtype."""
    gate = gate_up[..., :f]
    up = gate_up[..., f:]
    return (jax.nn.silu(gate) * up).astype(dtype)


def _einsum_f32(subscripts: str, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """einsum with f32 accumulation and an f32 result, for bf16 or f32 operands.

    XLA:CPU has no bf16 x bf16 -> f32 dot, so on CPU the operands are widened
    first (exact: a bf16 product is exact in f32); elsewhere the GEMM runs on the
    narrow operands.
    """
    def widened(a, b):
        return jnp.einsum(subscripts, a.astype(jnp.float32), b.astype(jnp.float32),
                          preferred_element_type=jnp.float32)

    def native(a, b):
        return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)

    return jax.lax.platform_dependent(lhs, rhs, cpu=widened, default=native)


def _combine(pair_out: jax.Array, weights: jax.Array, dtype) -> jax.Array:
    """[T, K, H] x.dtype expert outputs, [T, K] weights -> [T, H] in dtype.

    The weighted sum over k runs in f32; y is rounded once at the end.
    """
    weighted = pair_out.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]
    return jnp.sum(weighted, axis=1).astype(dtype)


def _sorted_pipeline(x, expert_ids, expert_weights, w_gate_up, w_down,
                     ragged_dot: RaggedDot, gemm_out_dtype=jnp.float32) -> jax.Array:
    """Sort pairs by expert, two grouped GEMMs through `ragged_dot`, unsort, combine.

    `gemm_out_dtype` is the dtype the GEMMs return (they accumulate in f32 either
    way): f32 per the contract, or x.dtype where a kernel's backward needs it.
    """
    t, h, k, e, f = _check_shapes(x, expert_ids, expert_weights, w_gate_up, w_down)
    n = t * k
    flat_ids = expert_ids.reshape(n).astype(jnp.int32)
    valid = (flat_ids >= 0) & (flat_ids < e)
    # Invalid pairs sort after every expert; rows past sum(group_sizes) are
    # outside every group, so ragged_dot leaves them 0.
    sort_key = jnp.where(valid, flat_ids, e)
    order = jnp.argsort(sort_key, stable=True)                        # [N]
    group_sizes = jnp.bincount(sort_key, length=e + 1)[:e].astype(jnp.int32)

    rows = jnp.take(x, order // k, axis=0)                            # [N, H]
    gate_up = ragged_dot(rows, w_gate_up, group_sizes,
                         preferred_element_type=gemm_out_dtype)       # [N, 2F]
    hidden = _swiglu(gate_up.astype(jnp.float32), f, x.dtype)         # [N, F]
    out = ragged_dot(hidden, w_down, group_sizes,
                     preferred_element_type=gemm_out_dtype).astype(x.dtype)  # [N, H]

    # Gather through the inverse permutation (its transpose is a scatter-add,
    # cheaper to differentiate than a scatter).
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(
        jnp.arange(n, dtype=jnp.int32))
    pair_out = jnp.take(out, inverse, axis=0).reshape(t, k, h)        # [T, K, H]
    weights = jnp.where(valid.reshape(t, k), expert_weights, 0)
    return _combine(pair_out, weights, x.dtype)


def ragged_dot_moe(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                   w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """MoE layer through `jax.lax.ragged_dot`: the pipeline JAX users write today.

    Flattens the T*K (token, k) pairs, stable-sorts them by expert id, gathers the
    x rows, runs `ragged_dot` with per-expert group sizes for gate/up ([N, H] x
    [E, H, 2F] -> [N, 2F] f32), SwiGLU in f32 rounded to x.dtype, `ragged_dot` for
    down ([N, F] x [E, F, H] -> [N, H] f32, rounded to x.dtype), unsorts, and sums
    the weighted rows over k in f32.

    Args:
      x: [T, H] bf16 or f32 tokens.
      expert_ids: [T, K] int32 expert ids.
      expert_weights: [T, K] f32 or x.dtype combine weights.
      w_gate_up: [E, H, 2F] x.dtype, gate columns [0, F), up columns [F, 2F).
      w_down: [E, F, H] x.dtype.

    Returns:
      y: [T, H] x.dtype.
    """
    return _sorted_pipeline(x, expert_ids, expert_weights, w_gate_up, w_down,
                            jax.lax.ragged_dot)


def dense_onehot_moe(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                     w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """MoE layer that runs every expert on every token (GShard-style, no capacity).

    One einsum over all E experts for gate/up ([T, H] x [E, H, 2F] -> [T, E, 2F]
    f32), SwiGLU in f32 rounded to x.dtype, one einsum for down
    ([T, E, F] x [E, F, H] -> [T, E, H] f32, rounded to x.dtype); each (t, k) pair
    then gathers its expert's row and the rows are summed over k in f32. Does E/K
    times the useful GEMM FLOPs and holds [T, E, max(2F, H)] f32 intermediates.

    Args:
      x: [T, H] bf16 or f32 tokens.
      expert_ids: [T, K] int32 expert ids.
      expert_weights: [T, K] f32 or x.dtype combine weights.
      w_gate_up: [E, H, 2F] x.dtype, gate columns [0, F), up columns [F, 2F).
      w_down: [E, F, H] x.dtype.

    Returns:
      y: [T, H] x.dtype.
    """
    _, _, _, e, f = _check_shapes(x, expert_ids, expert_weights, w_gate_up, w_down)
    gate_up = _einsum_f32("th,ehf->tef", x, w_gate_up)                # [T, E, 2F]
    hidden = _swiglu(gate_up, f, x.dtype)                             # [T, E, F]
    out = _einsum_f32("tef,efh->teh", hidden, w_down).astype(x.dtype)  # [T, E, H]
    ids = expert_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < e)
    pair_out = jnp.take_along_axis(
        out, jnp.where(valid, ids, 0)[..., None], axis=1)             # [T, K, H]
    weights = jnp.where(valid, expert_weights, 0)
    return _combine(pair_out, weights, x.dtype)


def _stub_xprof() -> list[str]:
    """Empty `xprof.cli.tools` modules, so that `import tokamax` works without xprof;
    returns the names it put in sys.modules (the caller removes them after importing).

    tokamax >= 0.0.17 imports xprof at the top of its own benchmarking helpers
    (tokamax/_src/benchmarking.py: `from xprof.cli.tools import
    get_kernel_stats_tool`), which `import tokamax` pulls in; its ragged_dot
    kernels never call it. The GPU machine has no xprof (and no wheel of a version
    that has `xprof.cli.tools` is on the index it can be brought from).
    """
    import types  # pylint: disable=import-outside-toplevel
    added = [name for name in ("xprof", "xprof.cli", "xprof.cli.tools")
             if name not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    tools = sys.modules["xprof.cli.tools"]
    if not hasattr(tools, "get_kernel_stats_tool"):
        tools.get_kernel_stats_tool = None
    sys.modules["xprof"].cli = sys.modules["xprof.cli"]
    sys.modules["xprof.cli"].tools = tools
    return added


@functools.cache
def tokamax_available() -> tuple[bool, str]:
    """(True, note) if `import tokamax` works, else (False, the reason).

    The note says when xprof had to be stubbed (see `_stub_xprof`).
    """
    try:
        import tokamax  # noqa: F401  pylint: disable=import-outside-toplevel
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("xprof"):
            return False, f"tokamax not importable: {type(err).__name__}: {err}"
        stubs = _stub_xprof()
        try:
            import tokamax  # noqa: F401,F811  pylint: disable=import-outside-toplevel
        except Exception as err2:  # pylint: disable=broad-except
            return False, f"tokamax not importable: {type(err2).__name__}: {err2}"
        finally:  # tokamax keeps its reference; nothing else should find the stub
            for name in stubs:
                sys.modules.pop(name, None)
        return True, "xprof missing: tokamax imported with an empty xprof stub"
    except Exception as err:  # pylint: disable=broad-except
        return False, f"tokamax not importable: {type(err).__name__}: {err}"
    return True, ""


def tokamax_moe(x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array,
                w_gate_up: jax.Array, w_down: jax.Array, *,
                implementation=None) -> jax.Array:
    """`ragged_dot_moe` with `tokamax.ragged_dot` (Pallas kernels) for both GEMMs.

    Same arguments, shapes and dtypes as `ragged_dot_moe`. One numerical
    difference: the GEMMs return x.dtype (accumulating in f32 inside the kernel), so
    gate and up are rounded to x.dtype before SwiGLU. tokamax's backward feeds the
    output cotangent to its kernels with the operands, and its Pallas kernels need
    one dtype for both (an f32 cotangent against bf16 weights raises).
    `implementation` is passed to `tokamax.ragged_dot` (None: tokamax picks,
    falling back to XLA; ("mosaic", "triton"): Pallas kernels only, raising where
    neither applies). Raises ImportError when tokamax is not installed.
    """
    import tokamax  # pylint: disable=import-outside-toplevel

    def ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type):
        return tokamax.ragged_dot(lhs, rhs, group_sizes,
                                  preferred_element_type=preferred_element_type,
                                  implementation=implementation)

    return _sorted_pipeline(x, expert_ids, expert_weights, w_gate_up, w_down,
                            ragged_dot, gemm_out_dtype=x.dtype)
