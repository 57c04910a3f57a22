"""mok_jax._src.primitives: the operand tables and what is derived from them, and the
ids of the NVLink transport's call sites."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import mok_jax
from mok_jax import comm
from mok_jax._src import primitives, sharding
from mok_jax._src.primitives import Array, Signature

CPUS = jax.devices("cpu")


def test_shardy_rules_come_from_the_operand_table():
    """The partitioned functions' rules, spelled out: a change of the table shows here."""
    assert sharding.FORWARD.rule() == "t h, t k, t k, e h g, e f h -> t h, s"
    assert sharding.FORWARD_SAVING.rule() == (
        "t h, t k, t k, e h g, e f h -> t h, s, t r h, t r g, t m")
    assert sharding.BACKWARD.rule() == (
        "t h, t k, t k, e h g, e f h, t h, t r h, t r g, t m -> t h, t k, e h g, e f h")
    assert sharding.FORWARD.replicated_factors({"t", "e"}) == ("h", "k", "g", "f", "s")
    assert sharding.BACKWARD.replicated_factors({"t", "e"}) == ("h", "k", "g", "f", "r", "m")


def test_shardings_split_tokens_and_experts_only():
    mesh = Mesh(np.array(CPUS[:4]).reshape(2, 2), ("dp", "ep"))
    operands, results = sharding.BACKWARD.shardings(mesh, {"t": ("dp", "ep"), "e": "ep"})
    specs = [s.spec for s in operands]
    assert specs[:5] == [P(("dp", "ep"), None), P(("dp", "ep"), None), P(("dp", "ep"), None),
                         P("ep", None, None), P("ep", None, None)]
    assert specs[6] == P(("dp", "ep"), None, None)  # residual rows follow their tokens
    assert [s.spec for s in results] == specs[:2] + specs[3:5]


def test_abstract_eval_takes_shapes_dtypes_and_rows_from_the_table():
    T, K, E, H, F = 6, 2, 3, 8, 4
    args = (jnp.zeros((T, H), jnp.bfloat16), jnp.zeros((T, K), jnp.int32),
            jnp.zeros((T, K), jnp.float32), jnp.zeros((E, H, 2 * F), jnp.bfloat16),
            jnp.zeros((E, F, H), jnp.bfloat16))
    for save, rows in ((True, T * K), (False, 0)):
        outs = jax.eval_shape(lambda *a: primitives.moe_fwd_p.bind(
            *a, capacity=-1, recipe=int(mok_jax.Recipe.NATIVE), save_gate_up=save), *args)
        assert [(o.shape, o.dtype) for o in outs] == [
            ((T, H), jnp.bfloat16), ((rows, 2 * F), jnp.bfloat16), ((rows, H), jnp.bfloat16),
            ((E,), jnp.int32), ((), jnp.int32), ((), jnp.int32)]


def test_a_table_rejects_an_operand_of_the_wrong_rank():
    sig = Signature((Array("a", "t h", "a"),), (Array("b", "t", "a"),))
    with pytest.raises(ValueError, match=r"a: expected rank 2"):
        sig.sizes([jax.ShapeDtypeStruct((3,), jnp.float32)])


def _sites(program_calls, monkeypatch):
    """The `site` attributes of a program with `program_calls` NVLink dispatches,
    lowered for CUDA (on any machine: the communicator is faked)."""
    monkeypatch.setattr(comm, "handle_for", lambda mesh, axis, need: (1, 2))
    monkeypatch.setattr(comm, "window_bytes", lambda *a: 0)
    mesh = Mesh(np.array(CPUS[:2]), ("ep",))
    T, K, H = 4, 2, 8

    def per_rank(values, entries, dest):
        rows = [primitives.ep_dispatch_p.bind(values, jnp.zeros((0,), jnp.float32), entries,
                                              dest, axis_name="ep", rows=2 * T * K)[0]
                for _ in range(program_calls)]
        return sum(rows)

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep"),
                      check_vma=False)
    args = (jnp.zeros((2 * T, H), jnp.bfloat16), jnp.zeros((4 * T,), jnp.int32),
            jnp.zeros((4 * T, K), jnp.int32))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [int(s) for s in re.findall(r"site = (\d+)", text)]


def test_call_sites_do_not_depend_on_what_the_process_compiled_before(monkeypatch):
    """Every process of an EP group must give a call the same site id (the transport's
    barriers compare them): compiling another program first, or the same one
    again, changes nothing; the calls of one program have different ids."""
    first = _sites(3, monkeypatch)
    _sites(1, monkeypatch)  # another program, compiled in between
    again = _sites(3, monkeypatch)
    assert len(first) == 3 and len(set(first)) == 3
    assert again == first
