"""mok_jax's CUDA calls inside XLA's command buffers (CUDA graphs).

The CUDA handlers are marked command-buffer compatible: XLA may record a call
once under stream capture and replay the graph without calling the handler. That
is only sound because every buffer a call touches, its workspace included, is
XLA's (the workspace is the custom call's last result, sized at lowering). These
tests run training steps with graphs on and off and compare the bits, check that
graphs really replay the calls, and that a call refuses a workspace too small.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mok_jax
from mok_jax import _ext, primitives

from conftest import make_problem

CASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "graph_replay_case.py")
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
GRAPHS_OFF = "--xla_gpu_enable_command_buffer="
GRAPHS_ON = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
GRAPHS_DEFAULT = "--xla_gpu_graph_min_graph_size=1"  # XLA's default command types


def _run_case(xla_flags: str, backend: str, steps: int = 6) -> dict:
    env = dict(os.environ, **SAFE_ENV, XLA_FLAGS=xla_flags)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, CASE, "--backend", backend, "--steps", str(steps)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["platform"] == "gpu"
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_steps_in_cuda_graphs_give_the_same_bits_and_replay_the_calls(backend):
    steps = 6
    off = _run_case(GRAPHS_OFF, backend, steps)
    on = _run_case(GRAPHS_ON, backend, steps)
    default = _run_case(GRAPHS_DEFAULT, backend, steps)
    # Without graphs every step runs the handlers (at least a forward and a backward).
    assert off["handler_calls"] >= 2 * steps
    assert np.all(np.isfinite(off["losses"]))
    assert len(set(off["losses"])) == steps  # the data (and so the routing) changed
    for name, run in (("on", on), ("default", default)):
        assert run["losses"] == off["losses"], (name, run, off)
        assert run["digest"] == off["digest"], (name, run, off)
        # Replayed calls do not run the handler: fewer runs than calls.
        assert run["handler_calls"] < off["handler_calls"], (name, run, off)


def _custom_call_line(module: str, target: str) -> str:
    lines = [ln for ln in module.splitlines() if f"custom_call @{target}(" in ln]
    assert len(lines) == 1, f"{len(lines)} custom calls to {target} in the lowered module"
    return lines[0]


@pytest.mark.skipif("cuda" not in _ext.registered_platforms(),
                    reason="the extension was built without its CUDA handlers")
@pytest.mark.parametrize("backend", ["auto", "xla"])
def test_workspace_is_the_last_result_of_each_cuda_call(backend):
    """Lowered for CUDA (no GPU needed), each mok_jax custom call ends in a uint8
    result of the bytes the extension asks for: XLA allocates the workspace."""
    T, K, E, H, F = 64, 2, 4, 128, 128
    x, ids, w, wgu, wd = make_problem(0, T=T, H=H, F=F, E=E, K=K, dtype=jnp.bfloat16)

    def loss(x, w, wgu, wd):
        return jnp.sum(mok_jax.moe(x, ids, w, wgu, wd, backend=backend).astype(jnp.float32))

    module = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(x, w, wgu, wd).lower(
        lowering_platforms=("cuda",)).as_text()
    bf16 = _ext.DType.BF16
    want = {  # rows are pairs (T * K) for the expert FFN: one device, no exchange
        "auto": {_ext.MOE_FORWARD: (T, K, E, H, F, True), _ext.MOE_BACKWARD: (T, K, E, H, F, False)},
        "xla": {_ext.EXPERT_FFN_FORWARD: (T * K, 1, E, H, F, True),
                _ext.EXPERT_FFN_BACKWARD: (T * K, 1, E, H, F, False),
                _ext.COMBINE: (T, K, 0, 0, 0, False)},
    }[backend]
    for target, (rows, top_k, experts, hidden, ffn, save) in want.items():
        nbytes = _ext.cuda_workspace_bytes(target, rows, top_k, experts, hidden, ffn, bf16, save)
        assert nbytes > 0
        line = _custom_call_line(module, target)
        assert line.rstrip().endswith(f"tensor<{nbytes}xui8>)"), line


@pytest.mark.gpu
def test_a_workspace_too_small_is_an_error(monkeypatch):
    x, ids, w, wgu, wd = make_problem(1, T=64, H=128, F=128, E=4, K=2, dtype=jnp.bfloat16)
    monkeypatch.setattr(_ext, "cuda_workspace_bytes", lambda *args: 16)
    with pytest.raises(Exception, match="workspace result has 16 bytes"):
        jax.block_until_ready(jax.jit(mok_jax.moe)(x, ids, w, wgu, wd))
    assert primitives  # the lowering reads _ext.cuda_workspace_bytes through the module
