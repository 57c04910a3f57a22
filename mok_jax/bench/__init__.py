"""`python -m mok_jax.bench`: `mok_jax.moe` side by side with pure-JAX baselines.

Method: each pipeline runs the whole MoE layer (dispatch and combine included,
routing excluded: expert ids and weights are made outside the timed function) on
the bench shapes below (or a custom `--shape T,K,E,H,F`), in bf16 by default. Each
pass is jitted and compiled, run `--warmup` times untimed (default 3), then timed
`--repeats` times (default 20), each run blocked on; a record reports the median
(and min and mean) of those runs. `--queue N` also times `--repeats` batches of N
calls dispatched back to back and blocked once (`queued ms`, per call): the
device-bound time, the regime of a training loop, which a blocked call exceeds by
its round trip to the host (~0.1 ms for a jitted call on a GPU). TFLOP/s count
GEMM FLOPs only: forward 6*T*K*H*F, forward+backward 18*T*K*H*F, credited alike
to every pipeline (so the dense one-hot baseline's E/K times larger GEMMs count
as waste). Every baseline is measured in the same process as `moe` (the PyTorch
ones, `--torch`, in a subprocess run just before). `mok speedup` is baseline median / `moe` median of
the same shape and pass (> 1: `moe` is faster).

EP (`--ep N`): `moe` on a mesh of N devices, experts and tokens sharded, T tokens
per device (weak scaling), once per exchange backend: `moe_epN_xla` (XLA's
all_to_all) and `moe_epN_fused` (mok_jax's NVLink transport; GPU only, recorded as
skipped on CPU and as unavailable on a GPU build without it). Their reference is
`moe_compute_epN`, measured in the same run: `moe` on ONE device with shape
(T, K, E/N, H, F), exactly one EP rank's expert work (the same T*K rows and GEMM
FLOPs per device, E/N experts, no communication; where K > E/N, T*K/(E/N) tokens
of E/N picks keep the rows). EP rows are reported as the time
ratio EP=N / compute-only (`ep_time_ratio`; lower is better, 1.00x is perfect
weak scaling), never as a speedup; the ratio to the single-device `moe` record with
all E experts is kept beside it (`ep_time_ratio_all_experts`). `--exchange` adds the
dispatch exchange alone: XLA's all_to_all variants on balanced synthetic rows, and
the fused transport's dispatch (`nvlink_pull`, with and without its route
computation) on the bench inputs' real routing, each with the bytes it moves per
device and GB/s.

GPU-only baselines (tokamax's Pallas kernels, the torch `_grouped_mm` ones,
ragged_all_to_all in `--exchange`) are not attempted on CPU: they are recorded as
skipped with the reason, and a note says so.

`--help` lists every shape with its dimensions and every pipeline, pass and
exchange with what it is. Combinations of flags that would time nothing, or not
what they name, are refused before anything runs.

Examples::

    python -m mok_jax.bench                                # default shapes, all impls, passes
    python -m mok_jax.bench --quick --repeats 5            # scaled-down shapes (CPU)
    python -m mok_jax.bench --shapes ep --impls moe,tokamax --passes fwd --json out.json
    python -m mok_jax.bench --shape 4096,8,64,2048,1024    # one custom problem only
    python -m mok_jax.bench --check                        # + errors vs the reference
    python -m mok_jax.bench --impls moe,ragged_dot --recipe native,fp8  # both recipes
    python -m mok_jax.bench --shapes ep --impls moe --ep 2  # + EP=2 (xla, fused) and
                                                           #   its compute-only reference

--check also compares every pipeline's y and gradients with the dense reference
(relative Frobenius error per output), so that a fast but wrong pipeline shows.

`--recipe native,fp8` runs `moe` (and its EP records) with each recipe named (fp8:
bf16 only); the fp8 rows' speedup columns are the native moe's medians over theirs;
the baselines and the --check reference keep computing in --dtype, so `moe`'s
errors there include the recipe's own (a few percent). Records carry `recipe`
(None for the JAX baselines, "fp8" for torch's FP8 grouped GEMM, which is compared
with `moe [fp8]`) and the table marks `moe [fp8]`.

On CPU the full shapes take very long; without --full-on-cpu a CPU run uses the
--quick shapes.

Modules: shapes (the problems and their inputs), pipelines (what is timed),
measure (one timed record), expert_parallel (--ep), exchanges (--exchange),
torch_baselines (--torch), report (tables, speedups, JSON legend), cli (flags and
main). The package itself offers what scripts build on: the shapes, their
inputs, build_step, persistent_kernels and main.
"""

from mok_jax.bench import (cli, exchanges, expert_parallel, measure, pipelines, report,
                           shapes, torch_baselines)
from mok_jax.bench.cli import main
from mok_jax.bench.measure import build_step
from mok_jax.bench.pipelines import RECIPES, persistent_kernels
from mok_jax.bench.shapes import (DEFAULT_SHAPES, FULL_SHAPES, QUICK_SHAPES, Shape, custom_shape,
                                  make_inputs, make_routing, make_tokens, skewed_expert_ids)

__all__ = ["DEFAULT_SHAPES", "FULL_SHAPES", "QUICK_SHAPES", "RECIPES", "Shape", "build_step",
           "cli", "custom_shape", "exchanges", "expert_parallel", "main", "make_inputs",
           "make_routing", "make_tokens", "measure", "persistent_kernels", "pipelines",
           "report", "shapes", "skewed_expert_ids", "torch_baselines"]
