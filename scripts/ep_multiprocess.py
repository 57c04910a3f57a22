"""Expert parallelism across processes (jax.distributed): bitwise equal to one device.

One process per GPU on a GPU machine, or several processes of host devices on
CPU (collectives through gloo). Every process builds the same global problem,
computes the single-device result on its own first device, then runs the EP
layer on a mesh over all processes' devices -- through `jax.shard_map` with
`axis_name` and through plain `jax.jit` on sharded arrays -- and checks that
its shards of y and of every gradient have the single-device bits.

    python scripts/ep_multiprocess.py --processes 2 --platform cpu --devices-per-process 2
    python scripts/ep_multiprocess.py --processes 8 --platform gpu      # one GPU each

Exit status 0 when every process agreed; the launcher kills the processes and
fails after --timeout seconds.

``--backend fused`` runs mok_jax's NVLink transport (GPUs only). Two fault
scenarios check that it fails cleanly rather than hanging or corrupting memory
(each process calls the transport's dispatch directly, so that no XLA collective
runs before its barrier):

    --scenario peer-exits     process 1 compiles, then exits before the call; the
                              others must fail within MOK_JAX_COMM_TIMEOUT_S
                              naming the rank and the phase they waited in
    --scenario shapes-differ  process 1 traces another token count; every process
                              must fail in the first barrier (signatures differ)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    """Starts the processes, relays their output, returns 0 if all of them passed."""
    port = _free_port()
    env = dict(os.environ)
    # NVLink multicast stays off in every process (shared machines; docs/architecture.md).
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    if args.scenario != "check":
        env.setdefault("MOK_JAX_COMM_TIMEOUT_S", "5")
    procs, logs = [], []
    for pid in range(args.processes):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", str(pid),
               "--coordinator", f"127.0.0.1:{port}"] + _forwarded(args)
        # Output to files, not pipes: a chatty process must not block on a full pipe.
        logs.append(tempfile.TemporaryFile(mode="w+"))
        procs.append(subprocess.Popen(cmd, env=env, stdout=logs[-1],
                                      stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + args.timeout
    codes = [None] * len(procs)
    while any(c is None for c in codes) and time.monotonic() < deadline:
        time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if args.scenario == "check" and any(c not in (None, 0) for c in codes):
            break  # one failed: the others would wait on it in a collective
    for p in procs:
        if p.poll() is None:
            p.kill()
    ok = True
    for pid, (p, log) in enumerate(zip(procs, logs)):
        code = p.wait()
        log.seek(0)
        out = log.read()
        log.close()
        for line in out.splitlines():
            if not line.startswith("[Gloo]"):
                print(f"[process {pid}] {line}")
        if code != 0:
            print(f"[process {pid}] exit status {code}"
                  + (" (killed: timeout or another process failed)" if code < 0 else ""))
            ok = False
    if args.scenario != "check":
        timed_out = any(c is None for c in codes)
        print(f"scenario {args.scenario}: "
              + ("TIMED OUT (a process hung)" if timed_out else "every process ended"))
        return 1 if timed_out else 0
    print("all processes bitwise equal to one device" if ok else "FAILED")
    return 0 if ok else 1


def _forwarded(args) -> list[str]:
    return (["--processes", str(args.processes), "--platform", args.platform,
             "--devices-per-process", str(args.devices_per_process), "--dtype", args.dtype,
             "--shape", args.shape, "--layers", args.layers, "--mesh-axes", args.mesh_axes,
             "--backend", args.backend, "--scenario", args.scenario]
            + (["--capacity-factor", str(args.capacity_factor)]
               if args.capacity_factor is not None else [])
            + (["--xla-dump", args.xla_dump] if args.xla_dump else []))


def child(args) -> int:
    """One process: initialise jax.distributed, compare its shards with one device."""
    if args.xla_dump:  # before jax starts: each process dumps its HLO, pass by pass
        where = os.path.join(os.path.abspath(args.xla_dump), f"process{args.child}")
        os.environ["XLA_FLAGS"] = " ".join(filter(None, (
            os.environ.get("XLA_FLAGS"), f"--xla_dump_to={where}",
            "--xla_dump_hlo_pass_re=.*", "--xla_dump_hlo_module_re=.*loss.*")))
    import jax  # pylint: disable=import-outside-toplevel
    if args.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices_per_process)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                                   process_id=args.child)
    else:
        d = args.devices_per_process
        jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                                   process_id=args.child,
                                   local_device_ids=list(range(args.child * d,
                                                               (args.child + 1) * d)))
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    import mok_jax  # pylint: disable=import-outside-toplevel

    if args.scenario != "check":
        return fault_scenario(args)

    n = jax.device_count()
    T, K, E, H, F = (int(v) for v in args.shape.split(","))
    T *= n  # T tokens per device
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype]
    if E % n:
        print(f"E={E} is not a multiple of the {n} devices")
        return 2

    # The same host problem in every process (numpy, seeded).
    rng = np.random.default_rng(0)
    scores = rng.random((T, E))
    ids = np.argsort(-scores, axis=1)[:, :K].astype(np.int32)
    ids[3, 0], ids[5, K - 1] = -1, E + 3                       # invalid ids
    w = np.sort(rng.random((T, K)), axis=1)[:, ::-1].astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    wgu = (rng.standard_normal((E, H, 2 * F)) * H**-0.5).astype(np.float32)
    wd = (rng.standard_normal((E, F, H)) * F**-0.5).astype(np.float32)
    cot = np.cos(np.arange(H, dtype=np.float32))
    cf = args.capacity_factor
    as_dtype = lambda a: np.asarray(jnp.asarray(a).astype(dtype))  # noqa: E731
    x, wgu, wd = as_dtype(x), as_dtype(wgu), as_dtype(wd)

    def loss_of(layer):
        def loss(x, w, wgu, wd, ids):
            y = layer(x, ids, w, wgu, wd)
            return jnp.sum(y.astype(jnp.float32) * cot), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    # One device: this process's first.
    local0 = jax.local_devices()[0]
    backend = args.backend
    one = loss_of(lambda x, ids, w, wgu, wd: mok_jax.moe(x, ids, w, wgu, wd,
                                                         capacity_factor=cf))
    (_, y1), g1 = one(*jax.device_put((x, w, wgu, wd, ids), local0))
    want = [np.asarray(a) for a in (y1,) + tuple(g1)]

    axis_type = {"explicit": jax.sharding.AxisType.Explicit,
                 "auto": jax.sharding.AxisType.Auto}[args.mesh_axes]
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(axis_type,))
    sharded = NamedSharding(mesh, P("ep"))

    def put(a):
        return jax.make_array_from_callback(a.shape, sharded, lambda idx: a[idx])

    args_ep = [put(a) for a in (x, w, wgu, wd, ids)]
    shard_map_layer = jax.shard_map(
        lambda x, ids, w, wgu, wd: mok_jax.moe(x, ids, w, wgu, wd, axis_name="ep",
                                               capacity_factor=cf, backend=backend),
        mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"), check_vma=True)
    plain_layer = lambda x, ids, w, wgu, wd: mok_jax.moe(  # noqa: E731
        x, ids, w, wgu, wd, capacity_factor=cf, backend=backend)

    failures = 0
    layers = {"shard_map": shard_map_layer, "plain jit": plain_layer}
    chosen = {"both": ("shard_map", "plain jit"), "shard_map": ("shard_map",),
              "plain": ("plain jit",)}[args.layers]
    for name in chosen:
        layer = layers[name]
        before = failures
        with jax.set_mesh(mesh):
            (_, y), g = loss_of(layer)(*args_ep)
        for what, got, ref in zip(("y", "dx", "d_expert_weights", "d_w_gate_up", "d_w_down"),
                                  (y,) + tuple(g), want):
            for shard in got.addressable_shards:
                a, b = np.asarray(shard.data), ref[shard.index]
                if a.shape != b.shape or not np.array_equal(a.view(np.uint8),
                                                            b.view(np.uint8)):
                    diff = (np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))
                            if a.shape == b.shape else "shape")
                    print(f"{name}: {what} shard {shard.index} differs (max |diff| {diff})")
                    failures += 1
        print(f"{name} ({backend}): EP={n} over {args.processes} processes, "
              f"{'bitwise equal' if failures == before else 'MISMATCH'} (y and 4 gradients, "
              f"{len(jax.local_devices())} local device(s))", flush=True)
    jax.distributed.shutdown()
    return 1 if failures else 0


def fault_scenario(args) -> int:
    """The transport's dispatch alone on a mesh over every process's GPUs (see the
    module docstring). Exit 3 when the call failed as it must, 1 when it did not."""
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
    from mok_jax import comm  # pylint: disable=import-outside-toplevel
    from mok_jax._src import primitives  # pylint: disable=import-outside-toplevel

    n = jax.device_count()
    T, K, _, H, _ = (int(v) for v in args.shape.split(","))
    if args.scenario == "shapes-differ" and args.child == 1:
        T //= 2
    mesh = jax.make_mesh((n,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))

    def dispatch(x, entries, dest):
        rows, _ = primitives.ep_dispatch_p.bind(
            x, jnp.zeros((0,), jnp.float32), entries, dest, axis_name="ep", rows=n * T * K)
        return rows

    # Every rank pulls every token of every rank into row u * K (k = 0 only).
    entries = np.tile(np.arange(n * T, dtype=np.int32), n)
    dest = np.full((n * n * T, K), -1, np.int32)
    dest[:, 0] = np.tile(np.arange(n * T, dtype=np.int32) * K, n)
    x = np.ones((n * T, H), np.float32)
    sharded = NamedSharding(mesh, P("ep"))
    put = lambda a: jax.make_array_from_callback(a.shape, sharded,  # noqa: E731
                                                 lambda idx: a[idx])
    step = jax.jit(jax.shard_map(dispatch, mesh=mesh, in_specs=(P("ep"),) * 3,
                                 out_specs=P("ep"), check_vma=False))
    operands = [put(a) for a in (x, entries, dest)]
    compiled = step.lower(*operands).compile()  # bootstraps the communicators (collective)
    print(f"compiled (T={T} per rank)", flush=True)
    if args.scenario == "peer-exits" and args.child == 1:
        print("exiting before the call", flush=True)
        os._exit(0)  # no jax.distributed.shutdown: the peer is simply gone
    time.sleep(1.0)
    start = time.monotonic()
    try:
        jax.block_until_ready(compiled(*operands))
    except Exception as err:  # the trapped kernel surfaces as XLA's error
        time.sleep(0.5)  # the watchdog polls every 50 ms
        print(f"call failed after {time.monotonic() - start:.1f} s: "
              f"{type(err).__name__}: {str(err)[:300]}", flush=True)
        print(f"mok_jax says: {comm.last_error()}", flush=True)
        os._exit(3)  # the CUDA context is unusable after a trap: no orderly teardown
    print("call RETURNED (expected a failure)", flush=True)
    os._exit(1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--platform", choices=["cpu", "gpu"], default="cpu")
    parser.add_argument("--devices-per-process", type=int, default=1,
                        help="host devices per process on CPU; GPUs per process on GPU")
    parser.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    parser.add_argument("--shape", default="64,4,16,128,64",
                        help="T per device, K, E, H, F (multiples of 8: tensor-core path)")
    parser.add_argument("--capacity-factor", type=float, default=None)
    parser.add_argument("--layers", choices=["both", "shard_map", "plain"], default="both",
                        help="which EP layers to check (plain: plain jax.jit on sharded "
                             "arrays, partitioned by mok_jax._src.sharding)")
    parser.add_argument("--mesh-axes", choices=["explicit", "auto"], default="explicit",
                        help="the mesh's axis type (jax.make_mesh's default is explicit)")
    parser.add_argument("--xla-dump", default=None, metavar="DIR",
                        help="dump each process's HLO pass by pass to DIR/process<i>")
    parser.add_argument("--backend", choices=["auto", "fused", "xla"], default="auto")
    parser.add_argument("--scenario", choices=["check", "peer-exits", "shapes-differ"],
                        default="check", help="fault scenarios of the fused transport")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    return child(args) if args.child is not None else launch(args)


if __name__ == "__main__":
    sys.exit(main())
