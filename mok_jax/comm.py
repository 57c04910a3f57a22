"""The NVLink communicators behind ``backend="fused"`` under expert parallelism.

One communicator per EP group (the devices along the EP mesh axis, for each
combination of the other mesh axes), each rank with one NCCL symmetric window
(``ncclMemAlloc`` + ``ncclCommWindowRegister(..., NCCL_WIN_COLL_SYMMETRIC)``)
and a device communicator (``ncclDevCommCreate``). They are made when a call
that needs them is lowered -- before any kernel runs -- for every local device
of the mesh at once, and reused by every later call on the same groups. A later
call with larger shapes gets a new set with a larger window (also made at
lowering); the old set stays for the executables compiled with it, so nothing
is torn down under a running step. All are destroyed at interpreter exit.

* One process driving several GPUs: every local rank's ``ncclCommInitRank`` in
  one NCCL group, with a unique id made here.
* One process per GPU (``jax.distributed``): the process holding a group's rank 0
  makes the unique id and publishes it in the ``jax.distributed`` key-value
  store under a key scoped by the group's device ids; the others wait for it.
  Every process must lower the same calls in the same order (they do when they
  run the same program); a process that lowers alone waits for its peers, at
  most ``KV_TIMEOUT_S`` (300 s), then fails with jax's key-value store error.

The C++ side (``mok_jax._mok_comm``, built when NCCL's device-API headers were
found) is imported only here, so ``import mok_jax`` never loads libnccl.

A rank that never arrives ends a barrier after ``MOK_JAX_COMM_TIMEOUT_S``
seconds (default 60): the kernel traps, the step fails with a CUDA error, and
mok_jax prints which rank waited for which, in which phase (`last_error`).
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import os
import threading
import warnings

import jax
import numpy as np

ENV_TIMEOUT = "MOK_JAX_COMM_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 1e9  # about 31 years
# The longest a process waits in the jax.distributed key-value store for its
# peers' bootstrap data (unique id, window size); then jax's error ends the wait.
KV_TIMEOUT_S = 300
_REQUIRED_ENV = {"NCCL_NVLS_ENABLE": "0"}

_lock = threading.Lock()


class Missing(RuntimeError):
    """The fused EP transport is not available in this build or on this machine."""


def _preload_nccl() -> None:
    """Loads libnccl.so.2 of the nvidia-nccl package (the NCCL JAX uses), so that the
    extension binds to that library rather than to another one on the search path."""
    try:
        import nvidia.nccl as pkg  # namespace package: no __file__
    except ImportError:
        return
    for root in list(pkg.__path__):
        lib = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            return


@functools.cache
def module():
    """``mok_jax._mok_comm`` with its FFI targets registered; `Missing` if absent."""
    for name, value in _REQUIRED_ENV.items():
        # NVLink multicast stays off (NCCL's symmetric kernels would ask for it).
        os.environ.setdefault(name, value)
    _preload_nccl()
    try:
        from mok_jax import _mok_comm
    except ImportError as err:
        raise Missing(
            "mok_jax was built without its fused EP transport (mok_jax._mok_comm), or "
            "its NCCL cannot be loaded: it needs the CUDA build and NCCL 2.28's "
            "device-API headers when mok_jax is compiled. Use backend='xla', or "
            "reinstall mok_jax with `MOK_CUDA=13 pip install --force-reinstall "
            f"\".[cuda13]\"` from the mok_jax source tree. ({err})") from err
    for name, capsule in _mok_comm.registrations()["CUDA"].items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    atexit.register(_shutdown)
    return _mok_comm


def available() -> bool:
    """Whether this build has the fused EP transport."""
    try:
        module()
    except Missing:
        return False
    return True


ROW_ALIGN = 16  # bytes: the transport moves rows as 16-byte vectors


def nccl_version_string(code: int) -> str:
    """NCCL's version code (``NCCL_VERSION_CODE``, e.g. 22809) as "2.28.9"."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def nccl_versions() -> tuple[str, str]:
    """(the NCCL the transport was built against, the NCCL loaded now)."""
    mod = module()
    return (nccl_version_string(int(mod.NCCL_HEADER_VERSION)),
            nccl_version_string(int(mod.nccl_runtime_version())))


def nccl_mismatch() -> str:
    """Why the fused transport cannot run with the NCCL loaded now ('' when it can:
    the device API it is compiled against differs between NCCL releases)."""
    built, loaded = nccl_versions()
    if built == loaded:
        return ""
    return (f"mok_jax's fused NVLink transport was built against NCCL {built}, but NCCL "
            f"{loaded} is loaded (the device API differs between releases). Install the "
            f"NCCL it was built for (pip install nvidia-nccl-cu13=={built}, as the cuda13 "
            "extra does) or rebuild mok_jax against this one (MOK_CUDA=13 pip install "
            "--force-reinstall --no-deps . from the mok_jax source tree).")


@functools.cache
def _auto_machine_ok() -> bool:
    if jax.process_count() != 1 or not available():
        return False
    mismatch = nccl_mismatch()
    if mismatch:  # create() would refuse it: stay on XLA's collectives, and say so once
        warnings.warn(f"{mismatch} backend='auto' uses XLA's collectives.", stacklevel=3)
        return False
    mod = module()
    ordinals = [int(d.local_hardware_id) for d in jax.local_devices(backend="gpu")]
    return all(mod.can_access_peer(a, b) for a in ordinals for b in ordinals if a != b)


def auto_selects_fused(platform: str, row_bytes: int) -> bool:
    """What ``backend="auto"`` does under EP: the fused transport when this build has
    it (with the NCCL it was built for), the mesh is on GPUs, one process drives
    them all (so every EP group is in this process), every local GPU can
    load/store every other's memory (one NVLink domain, as far as this process can
    tell) and a token row is a multiple of 16 bytes. Otherwise XLA's collectives;
    with one process per GPU ask for ``backend="fused"`` explicitly."""
    if platform not in ("gpu", "cuda") or row_bytes % ROW_ALIGN:
        return False
    return _auto_machine_ok()


def timeout_s() -> float:
    """The barrier timeout of `ENV_TIMEOUT`: a positive, finite number of seconds, at
    most `MAX_TIMEOUT_S` (the handlers count it in 64-bit nanoseconds)."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: expected a positive number of seconds, "
                         f"at most {MAX_TIMEOUT_S:g}")
    return value


def window_bytes(tokens: int, top_k: int, hidden: int, itemsize: int) -> int:
    """Bytes of the symmetric window one call of these shapes needs on every rank."""
    return int(module().window_bytes(tokens, top_k, hidden, itemsize))


def last_error() -> str:
    """The first barrier failure seen in this process ('' if none)."""
    return module().last_error()


@dataclasses.dataclass
class _Set:
    handle: int
    window_bytes: int


_sets: dict[tuple, _Set] = {}      # the newest set of each layout of groups
_retired: list[_Set] = []          # older (smaller) sets, kept for their executables
_created: dict[tuple, int] = {}    # sets made per layout: scopes the key-value keys


def ep_groups(mesh, axis_name: str) -> list[tuple]:
    """The EP groups of `mesh` along `axis_name`: one tuple of devices per
    combination of the other axes, ordered by their index along the axis."""
    devices = np.asarray(mesh.devices)
    axis = list(mesh.axis_names).index(axis_name)
    rows = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    return [tuple(row) for row in rows]


def _kv_client():
    from jax._src import distributed  # the key-value store of jax.distributed

    client = distributed.global_state.client
    if client is None:
        raise Missing("backend='fused' with EP groups that span processes needs "
                      "jax.distributed.initialize() (its key-value store carries the "
                      "NCCL unique id)")
    return client


def _scope(groups, build: int) -> str:
    """A key-value scope unique to this layout of groups and this creation of it."""
    return "{}/{}".format(build, ";".join("-".join(str(d.id) for d in g) for g in groups))


def fingerprint(groups) -> int:
    """A 63-bit id of the groups' devices, in order (checked by the handlers)."""
    import hashlib

    text = ";".join("-".join(str(d.id) for d in g) for g in groups).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") & (2**63 - 1)


def _group_specs(groups, build: int):
    """(nranks, local ranks, local CUDA ordinals, unique id) for every group with a
    device in this process, in the same order in every process."""
    me = jax.process_index()
    specs = []
    for group in groups:
        local = [(r, d) for r, d in enumerate(group) if d.process_index == me]
        if not local:
            continue
        ranks = [r for r, _ in local]
        ordinals = [int(d.local_hardware_id) for _, d in local]
        uid = b""
        if len(local) < len(group):
            key = "mok_jax/comm-id/{}/{}".format(_scope(groups, build),
                                                 "-".join(str(d.id) for d in group))
            client = _kv_client()
            if group[0].process_index == me:
                uid = bytes(module().unique_id())
                client.key_value_set_bytes(key, uid)
            else:
                uid = bytes(client.blocking_key_value_get_bytes(key, KV_TIMEOUT_S * 1000))
        specs.append((len(group), ranks, ordinals, uid))
    return specs


def _agreed_bytes(groups, need_bytes: int, build: int) -> int:
    """The window size every process of these groups uses: the largest any of them
    asks for (a window is registered collectively, so all ranks must agree; ranks
    that traced different shapes then fail in the first barrier, whose signature
    covers the shapes, instead of running on windows of different sizes)."""
    me = jax.process_index()
    processes = sorted({d.process_index for g in groups for d in g})
    if processes == [me]:
        return need_bytes
    client = _kv_client()
    scope = "mok_jax/comm-bytes/{}".format(_scope(groups, build))
    client.key_value_set_bytes(f"{scope}/{me}", str(int(need_bytes)).encode())
    sizes = [int(bytes(client.blocking_key_value_get_bytes(f"{scope}/{p}",
                                                          KV_TIMEOUT_S * 1000)))
             for p in processes]
    return max(sizes)


def handle_for(mesh, axis_name: str, need_bytes: int) -> tuple[int, int]:
    """The communicator set of `mesh`'s EP groups along `axis_name`, with windows
    of at least `need_bytes`: found, or made now (at lowering) on every local device
    together. Returns (handle, fingerprint), the FFI handlers' attributes."""
    mod = module()
    groups = ep_groups(mesh, axis_name)
    for group in groups:
        if any(d.platform != "gpu" for d in group):
            raise ValueError("mok_jax.moe: backend='fused' moves rows over NVLink between "
                             f"GPUs; the EP axis {axis_name!r} has devices of platform "
                             f"{group[0].platform!r}. Use backend='xla'.")
    key = tuple(tuple(d.id for d in g) for g in groups)
    print_ = fingerprint(groups)
    with _lock:
        s = _sets.get(key)
        if s is not None and s.window_bytes >= need_bytes:
            return s.handle, print_
        build = _created.get(key, 0)
        _created[key] = build + 1  # counted even if it fails: the next try gets new keys
        size = _agreed_bytes(groups, int(need_bytes), build)
        handle = int(mod.create(_group_specs(groups, build), size, timeout_s(), print_))
        if s is not None:
            _retired.append(s)
        _sets[key] = _Set(handle, size)
        return handle, print_


def _shutdown():
    err = module().shutdown()
    _sets.clear()
    _retired.clear()
    if err:
        import sys

        print(f"mok_jax: fused EP transport teardown: {err}", file=sys.stderr)
