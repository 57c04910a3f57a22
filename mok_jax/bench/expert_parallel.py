"""`--ep N`: mok_jax.moe on a mesh of N devices over each exchange backend, and
its reference, one rank's expert work on one device."""

from __future__ import annotations

import dataclasses
import functools
import traceback

import jax

from mok_jax.bench import pipelines
from mok_jax.bench.measure import (bench_one, build_step, error_string, finish_record,
                                   new_record, time_step)
from mok_jax.bench.pipelines import MOK, platform_skip, with_recipe
from mok_jax.bench.shapes import Shape, make_inputs


# The EP exchange backends timed by --ep (mok_jax.moe's `backend` under EP), and the
# GPU_ONLY name of the fused one.
EP_BACKENDS = ("xla", "fused")
FUSED_EP = "moe_epN_fused"


def ep_mesh(ep_size: int):
    """(a 1-D mesh "ep" over the first ep_size devices, None) or (None, why not)."""
    if len(jax.devices()) < ep_size:
        return None, f"needs {ep_size} devices, found {len(jax.devices())}"
    return jax.make_mesh((ep_size,), ("ep",), devices=jax.devices()[:ep_size]), None


def compute_only_shape(shape: Shape, ep_size: int) -> Shape:
    """One EP rank's expert work as a single-device problem: T tokens, top-K of
    E/ep_size experts, H, F (the same T*K rows, hence the same GEMM FLOPs, over the
    rank's E/P experts). Where K > E/P (K distinct picks do not fit), K' = E/P picks
    of T*K/K' tokens keep the rows; ValueError if T*K does not split so."""
    if shape.experts % ep_size:
        raise ValueError(f"E={shape.experts} experts do not split over {ep_size} devices")
    e_local = shape.experts // ep_size
    if shape.top_k <= e_local:
        return dataclasses.replace(shape, experts=e_local)
    rows = shape.tokens * shape.top_k
    if rows % e_local:
        raise ValueError(f"K={shape.top_k} > E/P={e_local} experts per device, and the "
                         f"T*K={rows} rows do not split into tokens of {e_local} picks")
    return dataclasses.replace(shape, tokens=rows // e_local, top_k=e_local,
                               experts=e_local)


def compute_only_impl(ep_size: int) -> str:
    return f"moe_compute_ep{ep_size}"


def ep_impl(ep_size: int, backend: str) -> str:
    return f"moe_ep{ep_size}_{backend}"


def bench_compute_only(shape: Shape, ep_size: int, pass_name: str, *, dtype,
                       dtype_name: str, seed: int, warmup: int, repeats: int,
                       verbose: bool = False, recipe: str = "native") -> dict:
    """`moe` on one device with compute_only_shape(shape, ep_size): the compute-only
    time of one EP rank (its rows and its E/P experts, no communication), the
    reference of the EP records' `ep_time_ratio`. Record impl `moe_compute_epN`; its
    T, K, E fields are the single-device problem's (E = E/N), `experts_global` and
    `compute_only_for_ep` say which EP problem it stands for."""
    impl = compute_only_impl(ep_size)
    try:
        local = compute_only_shape(shape, ep_size)
    except ValueError as err:
        record = new_record(dataclasses.replace(shape, experts=shape.experts // ep_size),
                            impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                            repeats=repeats)
        record.update(status="unavailable", error=str(err))
    else:
        try:
            inputs = make_inputs(local, dtype, seed)
        except Exception as err:  # pylint: disable=broad-except
            record = new_record(local, impl, pass_name, dtype_name=dtype_name,
                                warmup=warmup, repeats=repeats)
            record.update(status="error", error=error_string(err))
        else:
            record = bench_one(local, MOK, pass_name, inputs, dtype_name=dtype_name,
                               warmup=warmup, repeats=repeats, verbose=verbose,
                               recipe=recipe)
            del inputs
        record["impl"] = impl
    record.update(compute_only_for_ep=ep_size, experts_global=shape.experts,
                  backend="auto", recipe=recipe)
    if record["T"] != shape.tokens:
        record["note"] = (f"K={shape.top_k} > E/P={shape.experts // ep_size}: "
                          f"{record['T']} tokens x {record['K']} picks keep the "
                          f"{shape.tokens * shape.top_k} rows of one rank")
    return record


def fused_unavailable() -> str | None:
    """Why this build cannot run the fused EP transport (mok_jax._mok_comm missing,
    comm.Missing's message), or None. Call on GPU only (it loads libnccl)."""
    try:
        from mok_jax import comm  # pylint: disable=import-outside-toplevel
        comm.module()
    except Exception as err:  # pylint: disable=broad-except  (comm.Missing, import errors)
        return error_string(err)
    return None


def fused_skip(backend: str) -> tuple[str, str] | None:
    """(status, why) when the fused EP transport is not attempted here: "skipped" on
    a backend it cannot run on (platform_skip), "unavailable" on a GPU build without
    it; None when it can run."""
    why = platform_skip(FUSED_EP, backend)
    if why:
        return "skipped", why
    why = fused_unavailable()
    return ("unavailable", why) if why else None


def bench_ep(shape: Shape, ep_size: int, pass_name: str, *, dtype, dtype_name: str,
             seed: int, warmup: int, repeats: int, backend: str = "xla",
             verbose: bool = False, recipe: str = "native") -> dict:
    """`mok_jax.moe(..., backend=backend)` under jit on a mesh of `ep_size` devices
    (experts sharded; "xla": XLA's all_to_all, "fused": the NVLink transport), with
    `shape.tokens` tokens per device: the per-device work of the compute-only record
    (bench_compute_only), so the two times compare. Record impl `moe_epN_<backend>`."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
    impl = ep_impl(ep_size, backend)
    record = new_record(shape, impl, pass_name, dtype_name=dtype_name, warmup=warmup,
                        repeats=repeats)
    record.update(ep_size=ep_size, backend=backend,
                  experts_per_device=shape.experts // ep_size, recipe=recipe)
    if backend == "fused":
        skip = fused_skip(jax.default_backend())
        if skip:
            record.update(status=skip[0], error=skip[1])
            return record
    mesh, why = ep_mesh(ep_size)
    if mesh is None:
        record.update(status="unavailable", error=why)
        return record
    try:
        fn, why = pipelines.resolve_impl(MOK)
        if fn is None:
            record.update(status="unavailable", error=why)
            return record
        fn = with_recipe(fn, MOK, recipe)
        fn = functools.partial(fn, backend=backend)
        global_shape = dataclasses.replace(shape, tokens=shape.tokens * ep_size)
        inputs = make_inputs(global_shape, dtype, seed)
        # Tokens, routing, dy and the experts dim of both weights: all split on dim 0.
        sharded = NamedSharding(mesh, PartitionSpec("ep"))
        inputs = {k: jax.device_put(v, sharded) for k, v in inputs.items()}
        step, names = build_step(fn, pass_name)
        # Under the mesh, as the fused transport's plain-jit tests run it: its
        # lowering finds the EP group's devices there (primitives.lowering_mesh).
        with jax.set_mesh(mesh):
            compile_s, times_ms, _ = time_step(step, [inputs[n] for n in names],
                                               warmup=warmup, repeats=repeats)
    except Exception as err:  # pylint: disable=broad-except
        record.update(status="error", error=error_string(err))
        if verbose:
            traceback.print_exc()
        return record
    return finish_record(record, times_ms, compile_s)
