"""The `batchscore bench` subcommands (loaded by the CLI only when `batchscore bench` runs)."""

from __future__ import annotations

from batchscore.bench.command import bench as workloads
from batchscore.bench.gpu_bench import gpu
from batchscore.bench.mil_bench import mil

workloads.name = "workloads"
COMMANDS = [workloads, mil, gpu]
