"""The training state, its initialisation in its shardings, the train and eval
steps, and the optimizer."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mok_jax import nn as mnn

from moe_lm.config import Config, flops_per_token
from moe_lm.model import MoELM, abstract_model, init_rngs


class TrainState(NamedTuple):
    """Everything a step reads and writes; a checkpoint holds all of it but ``copies``."""

    step: jax.Array        # [] int32
    params: nnx.State      # nnx.Param leaves (float32: the master weights)
    bias: nnx.State        # mok_jax.nn.BalanceBias leaves (empty unless balance="bias")
    opt: Any               # optax state
    copies: nnx.State      # `weight_copies` of params (empty unless weight_copies and bf16)


EXPERT_STACKS = ("w_gate_up", "w_down")


def _is_expert_stack(path, _) -> bool:
    return bool(path) and path[-1] in EXPERT_STACKS


def uses_weight_copies(cfg: Config) -> bool:
    """Whether the state keeps `weight_copies`: asked for, and a 16-bit compute dtype."""
    return cfg.weight_copies and jnp.dtype(cfg.dtype) != jnp.float32


def weight_copies(params: nnx.State, dtype) -> nnx.State:
    """The MoE layers' expert stacks (``w_gate_up``, ``w_down``) of ``params`` in
    ``dtype``: what each layer casts them to before `mok_jax.moe`.

    With ``Config.weight_copies`` (and a 16-bit ``dtype``) the train state keeps
    them: the step that updates the f32 masters writes them in the same pass over
    the parameters, and the next step's forward takes them instead of reading the
    f32 stacks to cast them (1.7 ms of 123 in an h200-preset step on an H200,
    docs/ledger.md, 2026-12-01). The model computes the same function with the same gradients:
    the layer's cast is then the identity, and the gradient of an f32 master is
    the f32 value of its copy's gradient, which is what the cast's transpose gave."""
    stacks, _ = nnx.split_state(params, _is_expert_stack, ...)
    return jax.tree.map(lambda a: a.astype(dtype), stacks)


def make_optimizer(cfg: Config):
    """``(tx, schedule)``: AdamW (b2 0.95, weight decay on matrices only) after
    global-norm clipping, and its learning rate per step: a linear warm-up,
    ``lr * (step + 1) / warmup`` for the first ``warmup`` steps (so the first
    step learns and step ``warmup - 1`` is at ``lr``), then cosine decay to
    ``lr * min_lr_ratio`` at ``steps``."""
    import optax

    warmup = max(cfg.warmup, 1)
    schedule = optax.warmup_cosine_decay_schedule(
        cfg.lr / warmup, cfg.lr, warmup_steps=warmup - 1,
        decay_steps=max(cfg.steps, warmup), end_value=cfg.lr * cfg.min_lr_ratio)
    # No weight decay on norms (vectors); matrices and expert stacks decay.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                                 mask=decay_mask))
    return tx, schedule


def make_mesh(dp: int, ep: int, devices=None) -> Mesh:
    """A ``(dp, ep)`` mesh over the first ``dp * ep`` of ``devices`` (default: all);
    SystemExit when there are too few."""
    devices = list(jax.devices() if devices is None else devices)
    if dp < 1 or ep < 1 or dp * ep > len(devices):
        raise SystemExit(f"--dp {dp} --ep {ep} needs {dp * ep} devices; {len(devices)} visible")
    grid = np.array(devices[:dp * ep], dtype=object).reshape(dp, ep)
    return Mesh(grid, ("dp", "ep"), axis_types=(AxisType.Auto, AxisType.Auto))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Tokens (the batch dimension) over every mesh axis."""
    return NamedSharding(mesh, P(("dp", "ep")))


def init_state(cfg: Config, mesh: Mesh, tx, *,
               shard_optimizer: bool = False) -> tuple[nnx.GraphDef, TrainState, Any]:
    """Builds the model and optimizer state directly in their shardings.

    Returns ``(graphdef, state, state_shardings)``. Values do not depend on the
    mesh (random bits are sharding-invariant). ``shard_optimizer`` splits the
    optimizer state over ``dp`` as well (`shard_over_data`)."""

    def init():
        model = MoELM(cfg, rngs=init_rngs(cfg))
        _, params, bias = nnx.split(model, nnx.Param, mnn.BalanceBias)
        copies = weight_copies(params, cfg.dtype) if uses_weight_copies(cfg) else nnx.State({})
        return TrainState(jnp.zeros((), jnp.int32), params, bias, tx.init(params), copies)

    graphdef = nnx.split(abstract_model(cfg), nnx.Param, mnn.BalanceBias)[0]
    shapes = jax.eval_shape(init)
    shardings = mnn.named_shardings(shapes, mesh)
    if shard_optimizer:
        shardings = shardings._replace(opt=shard_over_data(shardings.opt, shapes.opt, mesh))
    state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings


def aux_totals(auxes: list[mnn.MoEAux]):
    """The layers' `mok_jax.nn.MoEAux` combined: ``(aux_loss, z_loss)`` averaged over
    the layers (f32 scalars), ``tokens_per_expert`` stacked ``[L, E]`` and ``dropped``
    summed."""
    aux_loss = sum(a.aux_loss for a in auxes) / len(auxes)
    z_loss = sum(a.z_loss for a in auxes) / len(auxes)
    tokens_per_expert = jnp.stack([a.tokens_per_expert for a in auxes])   # [L, E]
    dropped = sum(a.dropped for a in auxes)
    return aux_loss, z_loss, tokens_per_expert, dropped


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of ``logits [B, S, V]`` against ``targets [B, S]`` int32."""
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _grad_norm(grads) -> jax.Array:
    """The global norm exactly as optax.clip_by_global_norm computes it, so that XLA
    computes it once for the clipping and the log (a pass over every gradient)."""
    import optax

    tree = getattr(optax, "tree", None)
    return tree.norm(grads) if hasattr(tree, "norm") else optax.global_norm(grads)


def shard_over_data(shardings, shapes, mesh: Mesh, axis: str = "dp"):
    """``shardings`` with every array also split over the data-parallel ``axis``.

    Each array takes ``axis`` on its first dimension that is otherwise unsplit and
    divides by the axis size; arrays with no such dimension (scalars, vectors of
    odd length) keep their sharding. Used for the optimizer state and the
    update (ZeRO stage 1): each data-parallel replica keeps and updates 1/dp of
    the moments and parameters, the gradients are reduce-scattered and the new
    parameters all-gathered, instead of every replica updating all of them."""
    size = mesh.shape.get(axis, 1)

    def one(sharding, shape):
        if size == 1 or not isinstance(sharding, NamedSharding):
            return sharding
        spec = list(sharding.spec) + [None] * (len(shape.shape) - len(sharding.spec))
        used = {a for entry in spec if entry is not None
                for a in ((entry,) if isinstance(entry, str) else entry)}
        if axis in used:
            return sharding
        for dim, (entry, n) in enumerate(zip(spec, shape.shape)):
            if entry is None and n % size == 0:
                spec[dim] = axis
                return NamedSharding(mesh, P(*spec))
        return sharding

    return jax.tree.map(one, shardings, shapes)


def make_train_step(cfg: Config, graphdef, tx, schedule, *, update_shardings=None,
                    param_shardings=None):
    """``(state, batch [B, S+1] int32) -> (state, metrics)``, pure (jit it).

    ``update_shardings`` (a params-shaped tree of shardings, from
    `shard_over_data`) shards the gradients and the optimizer update over the
    data axis; ``param_shardings`` are then the parameters' own shardings, which
    the updated parameters are gathered back to."""
    import optax

    aux_coef = cfg.aux_coef if cfg.balance == "aux" else 0.0

    copies_on = uses_weight_copies(cfg)

    def loss_fn(params, copies, bias, batch):
        # params holds the rest of the parameters when copies holds the expert stacks
        model = nnx.merge(graphdef, params, copies, bias)
        logits, auxes = model(batch[:, :-1])
        with jax.named_scope("embed_and_loss"):
            ce = cross_entropy(logits, batch[:, 1:])
        with jax.named_scope("router"):
            aux_loss, z_loss, tokens_per_expert, dropped = aux_totals(auxes)
        loss = ce + aux_coef * aux_loss + cfg.z_coef * z_loss
        return loss, (ce, aux_loss, z_loss, tokens_per_expert, dropped)

    def train_step(state: TrainState, batch: jax.Array):
        if copies_on != bool(jax.tree.leaves(state.copies)):
            raise ValueError(
                f"train_step: the state {'lacks' if copies_on else 'holds'} the expert stacks' "
                f"copies but the step was built with weight_copies={cfg.weight_copies} and "
                f"dtype={cfg.dtype}: build the state and the step from the same Config")
        params = state.params
        if copies_on:
            _, params = nnx.split_state(params, _is_expert_stack, ...)
        (loss, (ce, aux_loss, z_loss, tpe, dropped)), (grads, copy_grads) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True)(params, state.copies, state.bias, batch)
        if copies_on:  # the f32 value of each copy's gradient: the cast's transpose
            grads = nnx.merge_state(grads, jax.tree.map(lambda g: g.astype(jnp.float32),
                                                        copy_grads))
        with jax.named_scope("optimizer"):
            params = state.params
            if update_shardings is not None:
                constrain = jax.lax.with_sharding_constraint
                grads, params = constrain(grads, update_shardings), constrain(
                    params, update_shardings)
            updates, opt = tx.update(grads, state.opt, params)
            params = optax.apply_updates(params, updates)
            if update_shardings is not None:
                params = jax.lax.with_sharding_constraint(params, param_shardings)
            copies = weight_copies(params, cfg.dtype) if copies_on else state.copies
        bias = state.bias
        if cfg.balance == "bias":
            model = nnx.merge(graphdef, params, state.bias)
            for (_, layer), counts in zip(mnn.moe_layers(model), tpe):
                layer.update_balance_bias(counts, cfg.bias_rate)
            bias = nnx.state(model, mnn.BalanceBias)
        counts = tpe.astype(jnp.float32)
        metrics = {
            "loss": loss, "ce": ce, "aux": aux_loss, "z": z_loss,
            "grad_norm": _grad_norm(grads), "lr": schedule(state.step),
            # Busiest expert over the mean, worst layer: 1.0 is perfect balance.
            "load_max": jnp.max(jnp.max(counts, axis=1) / jnp.mean(counts, axis=1)),
            "dropped": dropped,
        }
        return TrainState(state.step + 1, params, bias, opt, copies), metrics

    return train_step


def make_eval_step(graphdef):
    """``(params, bias, batch [B, S+1] int32) -> mean cross-entropy``, pure (jit it)."""

    def eval_step(params, bias, batch):
        logits, _ = nnx.merge(graphdef, params, bias)(batch[:, :-1])
        return cross_entropy(logits, batch[:, 1:])

    return eval_step


def trace_only(cfg: Config) -> dict:
    """Shapes of one train step, traced with jax.eval_shape (nothing is computed)."""
    tx, schedule = make_optimizer(cfg)
    model = abstract_model(cfg)
    graphdef, params, bias = nnx.split(model, nnx.Param, mnn.BalanceBias)
    copies = (jax.eval_shape(lambda p: weight_copies(p, cfg.dtype), params)
              if uses_weight_copies(cfg) else nnx.State({}))
    state = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params, bias,
                       jax.eval_shape(tx.init, params), copies)
    batch = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    new_state, metrics = jax.eval_shape(make_train_step(cfg, graphdef, tx, schedule), state, batch)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(new_state.params))
    return {"params": n_params, "metrics": {k: (v.shape, str(v.dtype)) for k, v in metrics.items()},
            "flops_per_token": flops_per_token(cfg)}
