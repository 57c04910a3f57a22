"""What the bench times: the pipelines by name (mok_jax.moe and its variants, the
pure-JAX baselines), the passes, the measurements that need a GPU and those
skipped by default."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mok_jax.bench import baselines
from mok_jax.bench.shapes import Shape


IMPLS = ("moe", "ragged_dot", "dense_onehot", "tokamax")
# Selectable, not run by default: mok_jax.moe forced onto its XLA-exchange path,
# and on one GPU with its forward always the kernel chain, or always the persistent
# kernel where that can run (moe picks between them by shape).
EXTRA_IMPLS = ("moe_xla", "moe_chain", "moe_persistent", "moe_vranks2", "moe_vranks4",
               "moe_vranks8")
# The EP role of the persistent kernels on P virtual ranks of one GPU.
VIRTUAL_RANKS = {"moe_vranks2": 2, "moe_vranks4": 4, "moe_vranks8": 8}
PASSES = ("fwd", "fwdbwd")

IMPL_ABOUT = {
    "moe": "mok_jax.moe, the layer under test (its C++/CUDA kernels through XLA FFI)",
    "ragged_dot": "pure JAX: sort the pairs by expert, jax.lax.ragged_dot for both "
                  "GEMMs, unsort, weighted sum",
    "dense_onehot": "pure JAX: every expert on every token (E/K times the GEMM work), "
                    "then pick and weight the K chosen",
    "tokamax": "the ragged_dot pipeline with tokamax.ragged_dot (Pallas Mosaic GPU "
               "kernels); needs a CUDA GPU",
    "moe_xla": "mok_jax.moe(backend='xla'): moe on its XLA-exchange path "
               "(not in the default list)",
    "moe_chain": "mok_jax.moe with both passes always the kernel chains (gathers, "
                 "grouped GEMMs, combines as separate kernels; not in the default list)",
    "moe_persistent": "mok_jax.moe with both passes always the persistent kernels where "
                      "they can run (one launch per pass after the routing plan; moe "
                      "picks them for few rows per expert only: both passes up to 256 "
                      "over 64 or more experts (4096 for experts of H*F <= 2048*1024), "
                      "over fewer the forward alone (up to 64 rows per expert; without "
                      "residuals 128, or 4096 for those experts with H >= 2048); same "
                      "bits; not in the default list)",
    **{name: f"mok_jax._src.ep.moe_on_virtual_ranks(ranks={p}): the persistent kernels as "
             f"{p} EP ranks in one launch per pass on one GPU, each with its own windows "
             "(T and E divisible by the ranks; the same bits as moe; compare with "
             "moe_persistent; not in the default list)"
       for name, p in VIRTUAL_RANKS.items()},
}
PASS_ABOUT = {
    "fwd": "y = layer(x, ids, weights, w_gate_up, w_down); GEMM FLOPs 6*T*K*H*F",
    "fwdbwd": "y and its VJP w.r.t. x, weights, w_gate_up, w_down; GEMM FLOPs "
              "18*T*K*H*F",
}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}
MOK = "moe"

# Measurements that need a CUDA GPU: on a CPU backend they are recorded as skipped
# with this reason (and a note is printed) instead of being attempted.
GPU_ONLY = {
    "moe_chain": "needs a CUDA GPU: the persistent kernels it switches off are CUDA "
                 "kernels (on CPU moe_chain would time moe again)",
    "moe_persistent": "needs a CUDA GPU: the persistent kernels are CUDA kernels (on CPU "
                      "moe_persistent would time moe again)",
    **{name: "needs a CUDA GPU: the persistent forward is a CUDA kernel"
       for name in VIRTUAL_RANKS},
    "tokamax": "needs a CUDA GPU: tokamax's Pallas Mosaic kernels run on GPUs only "
               "(on CPU tokamax.ragged_dot falls back to XLA's ragged_dot, which the "
               "ragged_dot row already times)",
    "torch_pipeline": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                      "JAX pipelines here run on the CPU, so a GPU time would not compare)",
    "torch_grouped_mm": "needs a CUDA GPU: torch._grouped_mm runs on CUDA only (and the "
                        "JAX pipelines here run on the CPU, so a GPU time would not "
                        "compare)",
    "torch_scaled_grouped_mm": "needs a CUDA GPU: torch._scaled_grouped_mm runs on "
                               "CUDA only (and the JAX pipelines here run on the CPU, so "
                               "a GPU time would not compare)",
    "ragged_all_to_all": "needs a GPU: XLA has no CPU lowering of ragged_all_to_all",
    "moe_epN_fused": "needs a CUDA GPU: backend='fused' moves the EP rows with mok_jax's "
                     "NVLink kernels, which run on GPUs only (on CPU mok_jax.moe raises "
                     "ValueError)",
    "nvlink_pull": "needs a CUDA GPU: the fused EP transport's dispatch (ep_dispatch_p) "
                   "pulls rows over NVLink and has no CPU lowering",
    "nvlink_pull_prerouted": "needs a CUDA GPU: the fused EP transport's dispatch "
                             "(ep_dispatch_p) pulls rows over NVLink and has no CPU "
                             "lowering",
}


def platform_skip(name: str, backend: str) -> str | None:
    """Why the pipeline, torch baseline, exchange or EP backend (FUSED_EP) `name` is
    not attempted on `backend` (a GPU-only one on CPU), or None."""
    if backend == "cpu" and name in GPU_ONLY:
        return GPU_ONLY[name]
    return None


MoEFn = Callable[..., jax.Array]


RECIPES = ("native", "fp8")
MOK_IMPLS = ("moe", "moe_xla", "moe_chain", "moe_persistent")
PERSISTENT_MODES = {"moe_chain": "OFF", "moe_persistent": "ALWAYS"}


def resolve_impl(name: str) -> tuple[MoEFn | None, str | None]:
    """The pipeline called `name`, or (None, why it is unavailable)."""
    if name in MOK_IMPLS:
        try:
            import mok_jax  # pylint: disable=import-outside-toplevel
            moe = mok_jax.moe
        except Exception as err:  # pylint: disable=broad-except
            return None, f"mok_jax.moe not importable: {type(err).__name__}: {err}"
        return (functools.partial(moe, backend="xla") if name == "moe_xla" else moe), None
    if name in VIRTUAL_RANKS:
        from mok_jax._src import ep  # pylint: disable=import-outside-toplevel
        return functools.partial(ep.moe_on_virtual_ranks, ranks=VIRTUAL_RANKS[name]), None
    if name == "ragged_dot":
        return baselines.ragged_dot_moe, None
    if name == "dense_onehot":
        return baselines.dense_onehot_moe, None
    if name == "tokamax":
        ok, why = baselines.tokamax_available()
        if not ok:
            return None, why
        # On GPU the Pallas Mosaic kernel only: tokamax's silent XLA fallback would
        # time ragged_dot again under tokamax's name. (tokamax 0.0.17 has no
        # "triton" ragged_dot; naming it raises.)
        impl = None if jax.default_backend() == "cpu" else "mosaic"
        return functools.partial(baselines.tokamax_moe, implementation=impl), None
    raise ValueError(f"unknown impl {name!r}; choose from {IMPLS + EXTRA_IMPLS}")


def with_recipe(fn: MoEFn, impl: str, recipe: str) -> MoEFn:
    """mok_jax's pipelines with `recipe` (their `recipe=`); the baselines as they are."""
    if impl in MOK_IMPLS and recipe != "native":
        return functools.partial(fn, recipe=recipe)
    return fn


@contextlib.contextmanager
def persistent_kernels(mode: str):
    """The persistent kernels of mok_jax's CUDA handlers in `mode` ("OFF", "AUTO",
    their default, or "ALWAYS") while the block runs; nothing where the build has
    none."""
    try:
        from mok_jax import _mok  # pylint: disable=import-outside-toplevel
    except ImportError:
        _mok = None
    setter = getattr(_mok, "set_persistent_kernels", None)
    if setter is None:
        yield
        return
    previous = setter(getattr(_mok.PersistentMode, mode))
    try:
        yield
    finally:
        setter(previous)


# XLA lowers ragged_dot's weight gradient to a dense masked f32 [E, T*K, H] tensor.
# On an H200 (jax 0.11.2) it failed to compile, after minutes, from 120 GB up
# (small-experts, deepseek-slice, ep; docs/performance.md); mixtral-like (4 GB) compiled.
RAGGED_DOT_DENSE_WGRAD_LIMIT = 64 * 2**30


def auto_skip(shape: Shape, impl: str, pass_name: str, backend: str) -> str | None:
    """Why a measurement is not attempted by default, or None."""
    if impl == "ragged_dot" and pass_name == "fwdbwd" and backend == "gpu":
        dense = shape.experts * shape.tokens * shape.top_k * shape.hidden * 4
        if dense >= RAGGED_DOT_DENSE_WGRAD_LIMIT:
            return (f"ragged_dot's backward needs a dense [E, T*K, H] f32 weight gradient "
                    f"({dense / 2**30:.0f} GiB) that XLA failed to compile on an H200; "
                    "--try-all attempts it")
    return None


def skipped(skips: Sequence[str], impl: str, pass_name: str, shape_name: str) -> bool:
    """Whether an entry of --skip ("impl/pass" or "impl/pass/shape") names this one."""
    return any(s in (f"{impl}/{pass_name}", f"{impl}/{pass_name}/{shape_name}")
               for s in skips)
