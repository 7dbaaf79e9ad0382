"""The load generator behind `qwen-serve bench`: traffic mixes, open/closed-loop arrivals, targets
(gRPC router, OpenAI HTTP, in-process engine), and an SLO report (table, JSON, PNG plots)."""

from qwenserve.loadgen.cli import main  # `qwen-serve bench` runs qwenserve.loadgen:main

__all__ = ["main"]
