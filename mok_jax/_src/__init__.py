"""mok_jax's internals: nothing here is API, and any of it may change.

* `primitives`: the JAX primitives, each defined once from a table of its arrays.
* `paths`: the one custom VJP over the execution paths of a call.
* `ep`: expert parallelism inside ``jax.shard_map`` (the layer cut at its seams).
* `transport`: how EP moves rows between ranks (XLA collectives or NVLink).
* `sharding`: `mok_jax.moe` under plain ``jax.jit`` on sharded arrays.
* `ext`: loading the native extension and registering its FFI targets.
* `seeds`: random keys from 63-bit integer seeds (the examples' and the bench's).
"""
