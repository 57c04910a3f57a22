"""The fp8 recipe's quantizer as an op, and its numerics in plain jnp.

* `quantize_rows_fp8(x)`: mok_jax's quantizer of the fp8 recipe (the kernels'
  own code, ``mok_quantize_rows_fp8``), for tests and users.
* `expert_outputs_fp8`: every expert's output on every token with the fp8 recipe's
  forward numerics, in jnp (f32 math and ``jnp.float8_e4m3fn`` conversions); the
  oracle `mok_jax.reference.moe_reference(recipe="fp8")` is built on it.

The rule (docs/contract.md, "The fp8 recipe"): a block's scale is
``s = amax / 448`` (f32 division; ``s = 1`` where that is 0) with ``amax`` the
largest ``|v|`` of the block, and each value becomes ``q8(v, s)``, the
float8_e4m3fn value of ``v / s`` (f32 division, round to nearest even, saturated
to +-448; NaN stays NaN).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._src import ext, primitives

BLOCK = 128        # length of every fp8 scale block
E4M3_MAX = 448.0   # largest finite float8_e4m3fn


# --- the op ------------------------------------------------------------------------

def _quantize_abstract_eval(x):
    if len(x.shape) != 2:
        raise ValueError(f"mok_jax.quantize_rows_fp8: x must be [N, K], got shape "
                         f"{tuple(x.shape)}")
    rows, cols = x.shape
    return (primitives.Result((rows, cols), np.dtype(jnp.float8_e4m3fn), (None, None)),
            primitives.Result((rows, math.ceil(cols / BLOCK)), np.dtype(np.float32),
                            (None, None)))


def _quantize_lowerings() -> dict:
    rule = primitives.ffi_lowering("cpu", ext.QUANTIZE_ROWS_FP8, lambda params: {})
    lowerings = {"cpu": rule}
    if ext.QUANTIZE_ROWS_FP8 in ext.registered_targets().get("cuda", frozenset()):
        lowerings["cuda"] = primitives.ffi_lowering("cuda", ext.QUANTIZE_ROWS_FP8,
                                                    lambda params: {})
    return lowerings


quantize_rows_fp8_p = primitives.define(
    ext.QUANTIZE_ROWS_FP8, None, abstract_eval=_quantize_abstract_eval,
    lowerings=_quantize_lowerings())


def quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Quantizes the rows of ``x`` to float8_e4m3fn in blocks of 128 along K, as
    the fp8 recipe quantizes its activations.

    For row ``i`` and block ``b`` (columns ``[128 b, min(128 b + 128, K))``, the
    last block shorter when ``K % 128 != 0``)::

        amax = max |x[i, j]| over the block               (f32)
        s    = amax / 448 (f32 division), or 1 where that is 0
        q[i, j] = float8_e4m3fn(x[i, j] / s)            (f32 division, then round
                                                         to nearest even, saturated
                                                         to +-448; NaN stays NaN)
        scales[i, b] = s

    so ``q.astype(float32) * scales`` (each scale repeated over its block)
    approximates ``x``. A NaN in a block makes its scale and every value of the
    block NaN; an Inf makes the scale Inf. The conversion gives the bits of CUDA's
    ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`` and of
    ``ml_dtypes``' ``np.clip(v, -448, 448).astype(float8_e4m3fn)``.

    Args:
      x: ``[N, K]`` float32 or bfloat16.
    Returns:
      ``(q, scales)``: ``q`` ``[N, K]`` float8_e4m3fn, ``scales``
      ``[N, ceil(K / 128)]`` float32.
    """
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"mok_jax.quantize_rows_fp8: x must be an array, got "
                         f"{type(x).__name__}")
    if np.ndim(x) != 2:
        raise ValueError(f"mok_jax.quantize_rows_fp8: x must be [N, K], got shape "
                         f"{tuple(np.shape(x))}")
    if np.dtype(x.dtype) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise ValueError(f"mok_jax.quantize_rows_fp8: x must be float32 or bfloat16, got "
                         f"{np.dtype(x.dtype)}")
    q, scales = quantize_rows_fp8_p.bind(x)
    return q, scales


# --- the recipe's forward in jnp -----------------------------------------------------

def _divide(a, b):
    """a / b as an IEEE f32 division. XLA rewrites a division by a constant or by
    a broadcast value into a product with its reciprocal, which rounds
    differently; behind the barrier it sees neither."""
    a, b = jnp.broadcast_arrays(a, b)
    return a / jax.lax.optimization_barrier(b)


def _scale(amax):
    s = _divide(amax, jnp.float32(E4M3_MAX))
    return jnp.where(s == 0, jnp.float32(1), s)


@jax.custom_jvp
def _q8(v, s):
    """float8_e4m3fn value of v / s as f32 (clip to +-448: saturation; NaN stays).

    Its derivative is that of v / s with s held constant (a straight-through
    estimator): ``q8(v, s) * s`` then differentiates as ``v``. Differentiated as
    written, the float8 conversions' transposes would round the cotangent
    itself to e4m3 without a scale (zero under 2^-10, NaN over 448)."""
    q = jnp.clip(_divide(v, s), -E4M3_MAX, E4M3_MAX)
    return q.astype(jnp.float8_e4m3fn).astype(jnp.float32)


@_q8.defjvp
def _q8_jvp(primals, tangents):
    v, s = primals
    return _q8(v, s), _divide(tangents[0], s)


def _pad_to_blocks(v, axis):
    n = v.shape[axis]
    pad = -n % BLOCK
    if pad == 0:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, pad)
    return jnp.pad(v, widths)


def quantize_last_axis(v):
    """Row blocks of 128 along the last axis: ``(q, s)``, ``q`` like ``v`` (f32
    values of e4m3 numbers), ``s`` ``[..., nblocks]``."""
    n = v.shape[-1]
    p = _pad_to_blocks(v.astype(jnp.float32), -1)
    nb = p.shape[-1] // BLOCK  # by name: a reshape's -1 is undefined for no rows
    p = p.reshape(*p.shape[:-1], nb, BLOCK)
    s = jax.lax.stop_gradient(_scale(jnp.max(jnp.abs(p), axis=-1)))
    q = _q8(p, s[..., None]).reshape(*v.shape[:-1], nb * BLOCK)[..., :n]
    return q, s


def quantize_matrices(w):
    """128x128 blocks of ``w`` ``[E, R, C]``: ``(q, s_col)`` with ``s_col``
    ``[E, nRb, C]``, each column block's scale repeated over its columns."""
    e, r, c = w.shape
    p = _pad_to_blocks(_pad_to_blocks(w.astype(jnp.float32), 1), 2)
    nr, nc = p.shape[1] // BLOCK, p.shape[2] // BLOCK
    p = p.reshape(e, nr, BLOCK, nc, BLOCK)
    s = jax.lax.stop_gradient(_scale(jnp.max(jnp.abs(p), axis=(2, 4))))  # [E, nRb, nCb]
    q = _q8(p, s[:, :, None, :, None]).reshape(e, nr * BLOCK, nc * BLOCK)[:, :r, :c]
    s_col = jnp.repeat(s, BLOCK, axis=2)[:, :, :c]
    return q, s_col


def _gemm(aq, sa, bq, sb_col):
    """``[E, T, N]``: sum over K-blocks kb ascending of
    ``P_kb * (sa[:, kb] * sb_col[:, kb])`` with ``P_kb`` the f32 product of the
    block's e4m3 values. aq ``[T, K]`` or ``[E, T, K]``, sa ``[..., T, nkb]``, bq
    ``[E, K, N]``, sb_col ``[E, nkb, N]``."""
    ap = _pad_to_blocks(aq, -1)
    nkb = ap.shape[-1] // BLOCK  # by name: a reshape's -1 is undefined for no rows
    ap = ap.reshape(*ap.shape[:-1], nkb, BLOCK)
    bp = _pad_to_blocks(bq, 1)
    bp = bp.reshape(bq.shape[0], nkb, BLOCK, bq.shape[2])
    spec = "tbk,ebkn->betn" if aq.ndim == 2 else "etbk,ebkn->betn"
    p = jnp.einsum(spec, ap, bp, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
    acc = jnp.zeros(p.shape[1:], jnp.float32)
    for b in range(p.shape[0]):
        sa_b = sa[..., b][..., None]                     # [(E,) T, 1]
        acc = acc + p[b] * (sa_b * sb_col[:, b][:, None, :])
    return acc


def expert_outputs_fp8(x, w_gate_up, w_down):
    """Every expert on every token with the fp8 recipe: ``[E, T, H]`` f32 holding
    the outputs rounded to bfloat16 (the weights bfloat16; x ``[T, H]``, or
    ``[E, T, H]`` with a row per expert, holding bfloat16 values)."""
    ffn = w_down.shape[1]
    xq, sx = quantize_last_axis(x)
    gq, gs = quantize_matrices(w_gate_up[:, :, :ffn])
    uq, us = quantize_matrices(w_gate_up[:, :, ffn:])
    wq = jnp.concatenate([gq, uq], axis=2)
    ws = jnp.concatenate([gs, us], axis=2)
    gate_up = _gemm(xq, sx, wq, ws)                      # [E, T, 2F]
    g, u = gate_up[..., :ffn], gate_up[..., ffn:]
    h = g * (1 / (1 + jnp.exp(-g))) * u                  # f32, not rounded
    hq, sh = quantize_last_axis(h)
    dq, ds = quantize_matrices(w_down)
    o = _gemm(hq, sh, dq, ds)
    return o.astype(jnp.bfloat16).astype(jnp.float32)
