"""Functions a test runs inside a vLLM worker (``LLM.collective_rpc``): keep what vLLM's loggers
emit there between ``start`` and ``stop``.

vLLM's loggers do not reach pytest's ``caplog``: the ``vllm`` logger has its own handler and
``propagate=False`` (vllm/logger.py), and a separate engine logs in its own process. A handler
added to ``vllm`` in the worker's process sees every record its child loggers let through (a
child logger's filters run before any ancestor's handler).
"""

from __future__ import annotations

import logging


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


def start(worker) -> bool:
    """Keep vLLM's records from now on (one recorder per worker)."""
    if hasattr(worker, "_test_log_keeper"):
        raise RuntimeError("vLLM log capture already started in this worker")
    worker._test_log_keeper = _Keep()
    logging.getLogger("vllm").addHandler(worker._test_log_keeper)
    return True


def probe(worker) -> bool:
    """Log the two partial-reload warnings as vLLM's reload modules do, outside any refit: a
    capture that keeps them shows that nothing silences those loggers between refits."""
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
        "%s: Failed to load weights", "ProbeLayer")
    logging.getLogger("vllm.model_executor.model_loader.reload.inplace").warning(
        "Following weights were not loaded from checkpoint: %s", {"probe.weight"})
    return True


def stop(worker) -> list[str]:
    """Stop keeping; return the kept messages as ``"<logger>: <message>"``."""
    keeper = worker.__dict__.pop("_test_log_keeper")
    logging.getLogger("vllm").removeHandler(keeper)
    return keeper.messages
