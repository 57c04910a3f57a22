"""The router's math: its logits at f32 accuracy and its top-k, for `mok_jax.nn.MoE`.

* `router_logits`: ``tokens @ kernel`` in f32 at f32 accuracy; for bfloat16
  tokens from bf16 matrix products of the kernel's exact three-term split, both
  ways (a custom VJP).
* `top_k`: the k largest scores per token as K rounds of argmax, which XLA's
  partitioner keeps sharded along the tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mok_jax._src import primitives


def top_k(select: jax.Array, values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Indices ``[..., k]`` int32 of the k largest ``select`` along its last axis
    (ties: lower index first, as ``jax.lax.top_k``; -0.0 and 0.0 tie, where
    ``lax.top_k`` puts 0.0 first) and ``values`` (select's shape) at them
    ``[..., k]``, in values' dtype. Leading dimensions are rows (tokens).

    K rounds of argmax rather than ``lax.top_k``: XLA's partitioner runs its TopK
    custom call replicated, gathering the scores of every token onto every
    device, while argmax and masks stay sharded along the tokens.
    """
    select, values = jnp.asarray(select), jnp.asarray(values)
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"top_k: k must be an int, got {k!r}")
    if select.ndim < 1:
        raise ValueError("top_k: select must have at least one axis (the experts)")
    if values.shape != select.shape:
        raise ValueError(f"top_k: values {list(values.shape)} must have select's shape "
                         f"{list(select.shape)}")
    num_experts = select.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"top_k: k={k} must be in [1, {num_experts}], the experts in "
                         f"select's last axis (shape {select.shape})")
    if select.dtype == jnp.bool_:
        select = select.astype(jnp.int32)
    # Below every score: -inf for floats, the type's least value for integers
    # (a float would round integers past its significand together).
    lowest = (-jnp.inf if jnp.issubdtype(select.dtype, jnp.inexact)
              else jnp.iinfo(select.dtype).min)
    ids, picked = [], []
    taken = jnp.zeros_like(select, dtype=bool)  # select's sharding (Explicit meshes)
    experts = jnp.arange(num_experts)
    zero = jnp.zeros((), values.dtype)
    for _ in range(k):
        # argmax's choice among the untaken scores (NaN the largest, ties to the lower
        # index, as lax.top_k orders them); taken ones are masked with the lowest
        # value, so where every untaken score is that value too, argmax may return a
        # taken index: then the lowest untaken one, which is lax.top_k's choice
        # among those ties.
        best = jnp.argmax(jnp.where(taken, lowest, select), axis=-1)
        again = jnp.any(taken & (best[..., None] == experts), axis=-1)
        best = jnp.where(again, jnp.argmax(~taken, axis=-1), best)
        chosen = best[..., None] == experts
        ids.append(best)
        # exact: one term
        picked.append(jnp.sum(jnp.where(chosen, values, zero), axis=-1, dtype=values.dtype))
        taken = taken | chosen
    return jnp.stack(ids, axis=-1).astype(jnp.int32), jnp.stack(picked, axis=-1)


ROUTER_DOTS = ("auto", "highest")


def _bf16_terms(a: jax.Array, n: int) -> list[jax.Array]:
    """``n`` bfloat16 arrays whose f32 sum is ``a`` (f32): each term is what is left
    of ``a`` after the previous ones, rounded to bfloat16. Three terms carry all 24
    bits of an f32 significand (bar subnormal remainders); two carry 16.

    The rounding is a ``reduce_precision`` in f32 followed by an exact convert:
    XLA may fold an f32 -> bf16 -> f32 round trip into the identity when it allows
    excess precision (its GPU default), which would zero every later term."""
    terms = []
    rest = a.astype(jnp.float32)
    for i in range(n):
        term = jax.lax.reduce_precision(rest, exponent_bits=8, mantissa_bits=7)
        terms.append(term.astype(jnp.bfloat16))
        if i + 1 < n:
            rest = rest - term
    return terms


@jax.custom_vjp
def _split_router_logits(tokens: jax.Array, kernel: jax.Array) -> jax.Array:
    """``tokens [..., H]`` (bfloat16) @ ``kernel [H, E]`` (f32) -> ``[..., E]`` f32 at f32
    accuracy from bfloat16 matrix products: the kernel is three bf16 terms (its
    exact value), a bf16 x bf16 product is exact in f32, and the products
    accumulate in f32. One GEMM ``[T, H] x [H, 3E]`` reads the tokens once, in
    bf16, where an f32 dot reads them widened (the router's part of an
    h200-preset step on an H200: 4.1 ms with XLA's f32 ``HIGHEST`` dots, 2.0 ms
    with these, docs/ledger.md, d323f28)."""
    return _split_router_fwd(tokens, kernel)[0]


def _sum_terms(stacked: jax.Array, n: int, axis: int) -> jax.Array:
    """``stacked`` with ``axis`` of size ``n * m`` -> the f32 sum of its ``n`` blocks of
    ``m``, smallest (last) first."""
    parts = jnp.split(stacked, n, axis=axis)
    total = parts[-1]
    for part in reversed(parts[:-1]):
        total = total + part
    return total


def _split_router_fwd(tokens, kernel):
    w = jnp.concatenate(_bf16_terms(kernel, 3), axis=1)                       # [H, 3E]
    products = jnp.dot(tokens, w, preferred_element_type=jnp.float32)       # [..., 3E]
    return _sum_terms(products, 3, axis=-1), (tokens, w)


def _explicit_sharding(x: jax.Array):
    """``x``'s sharding where its mesh (the context's, else the one its type names)
    has Explicit axes, else None: there a dot that contracts a sharded dimension
    must be told its result's sharding."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    return jax.typeof(x).sharding


def _split_router_bwd(residuals, d_logits):
    tokens, w = residuals  # w: the kernel's three terms, [H, 3E], from the forward
    d_terms = _bf16_terms(d_logits, 3)
    # d kernel [H, E] = tokens^T d_logits over every leading dimension, d_logits
    # exact in three terms. The contracted dimensions are the tokens' (sharded on
    # a data-parallel mesh): the result is sharded as the kernel's terms are.
    lead = tuple(range(tokens.ndim - 1))
    d_kernel = _sum_terms(jax.lax.dot_general(
        tokens, jnp.concatenate(d_terms, axis=-1), ((lead, lead), ((), ())),
        preferred_element_type=jnp.float32, out_sharding=_explicit_sharding(w)), 3, axis=1)
    # d tokens [..., H] = d_logits kernel^T: the six products of three terms a side
    # whose term indices sum to at most 2 (the rest are below 2^-24 of the scale).
    w_terms = jnp.split(w, 3, axis=1)
    pairs = [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0)]
    lhs = jnp.concatenate([d_terms[i] for i, _ in pairs], axis=-1)         # [..., 6E]
    rhs = jnp.concatenate([w_terms[j] for _, j in pairs], axis=1)          # [H, 6E]
    # Accumulated in f32 and rounded once, to the tokens' dtype, by the GEMM.
    # (Contracted over 6E: sharded where the kernel's E is.)
    d_tokens = jnp.dot(lhs, rhs.T, preferred_element_type=tokens.dtype,
                       out_sharding=_explicit_sharding(tokens))
    return d_tokens, d_kernel  # f32: router_logits passes the kernel in f32


_split_router_logits.defvjp(_split_router_fwd, _split_router_bwd)


def router_logits(tokens: jax.Array, kernel: jax.Array, router_dot: str = "auto") -> jax.Array:
    """The router's logits ``tokens [T, H] @ kernel [H, E]`` in f32, at f32 accuracy.

    ``router_dot="highest"``: XLA's f32 dot with ``Precision.HIGHEST`` on the
    tokens widened to f32. ``"auto"``: the same for float32 tokens; for bfloat16
    tokens (whose values bf16 holds exactly) bf16 matrix products of the tokens
    with the kernel's exact three-term bf16 split, f32 accumulation, and the same
    in the backward pass (d_logits split into three terms as well). Both agree to
    f32 rounding: they sum the same exact products in different orders. (The
    split is exact for values whose remainders stay in bf16's normal range,
    i.e. above ~2^-110 in magnitude, and below bf16's largest value, ~3.4e38.)

    ``tokens`` may have leading dimensions (``[..., H]`` -> ``[..., E]``); other
    shapes (a scalar, a kernel not ``[H, E]``, another H) raise ValueError. Inside
    ``shard_map`` the kernel is cast to vary over the tokens' axes first, so its
    gradient is summed over them (as for the f32 dot)."""
    if router_dot not in ROUTER_DOTS:
        raise ValueError(f"router_logits: router_dot must be one of {ROUTER_DOTS}, "
                         f"got {router_dot!r}")
    tokens, kernel = jnp.asarray(tokens), jnp.asarray(kernel)
    if kernel.ndim != 2:
        raise ValueError(f"router_logits: kernel must be [H, E], got shape {kernel.shape}")
    if tokens.ndim < 1:
        raise ValueError("router_logits: tokens must have at least one axis (the hidden one)")
    if tokens.shape[-1] != kernel.shape[0]:
        raise ValueError(f"router_logits: tokens' last dimension ({tokens.shape}) must be "
                         f"the kernel's H ({kernel.shape})")
    if (router_dot == "auto" and tokens.dtype == jnp.bfloat16
            and kernel.dtype in (jnp.float32, jnp.bfloat16)):
        tokens, kernel = primitives.vary_alike((tokens, kernel.astype(jnp.float32)))
        return _split_router_logits(tokens, kernel)
    return jnp.dot(tokens.astype(jnp.float32), kernel.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
