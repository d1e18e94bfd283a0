"""The `batchscore bench` subcommands (loaded by the CLI only when `batchscore bench` runs).

`workloads` is the throughput suite: `batchscore bench micro-2000-200 --scale ci` is routed to it.
The modules import torch, transformers and vLLM only inside the commands, so `--help` is quick.
"""

from __future__ import annotations

from batchscore.bench.attention_floor import attention
from batchscore.bench.command import workloads
from batchscore.bench.decisions_bench import decisions
from batchscore.bench.dtype_parity import dtype_parity
from batchscore.bench.engine_bench import engine
from batchscore.bench.fixed_costs import fixed_costs
from batchscore.bench.gpu_command import gpu
from batchscore.bench.invariance import invariance
from batchscore.bench.labels_bench import labels
from batchscore.bench.lm_eval_bench import lm_eval_bench
from batchscore.bench.mil_bench import mil
from batchscore.bench.placement_bench import placement
from batchscore.bench.plan_bench import plan
from batchscore.bench.scale_bench import scale
from batchscore.bench.specprefill import specprefill
from batchscore.bench.tokenize_store import tokenize_store
from batchscore.bench.vllm_bench import vllm

COMMANDS = [workloads, plan, engine, attention, vllm, gpu, mil, scale, placement, dtype_parity, specprefill, labels,
            decisions, invariance, tokenize_store, fixed_costs, lm_eval_bench]

__all__ = ["COMMANDS"]
