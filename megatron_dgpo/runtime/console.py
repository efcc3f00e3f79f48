"""What a run's console shows: its progress, the project's own lines, and what needs the user.

``route_notices(log_file)`` sends other packages' notices to ``log_file`` instead: Python
warnings raised outside this package, their loggers' records below ERROR (Megatron-Core's
"GPTModel IS DEPRECATED", torch's, transformers'), and vLLM's log lines in this process and in
every process it starts (vLLM configures its own logging per process, from
``VLLM_LOGGING_CONFIG_PATH``). Errors, and the package's own warnings and records, stay on the
console (and are in the file too). Output written straight to the terminal by C++ code or
progress bars is left as it is.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PACKAGE = PACKAGE_DIR.name
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class Notices(logging.Handler):
    """The console for the package's records and errors, ``path`` for every record."""

    def __init__(self, path: Path):
        super().__init__()
        self.file = logging.FileHandler(path, delay=True, encoding="utf-8")
        self.file.setFormatter(logging.Formatter(FORMAT))
        self.console = logging.StreamHandler(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] == PACKAGE or record.levelno >= logging.ERROR:
            self.console.handle(record)
        self.file.handle(record)

    def close(self) -> None:
        self.file.close()
        super().close()


def route_notices(log_file: str | os.PathLike) -> Notices:
    """Send other packages' notices of this process, and vLLM's of the processes it starts, to
    ``log_file`` (module docstring); returns the handler installed on the root logger."""
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    notices = Notices(path)
    logging.getLogger().addHandler(notices)
    for logger in _loggers_printing_to_the_terminal():  # torch's, transformers' own handlers
        for handler in [h for h in logger.handlers if _to_terminal(h)]:
            logger.removeHandler(handler)
        logger.addHandler(notices)
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        vllm_config = path.with_name(path.stem + ".vllm-logging.json")
        vllm_config.write_text(json.dumps(vllm_logging_config(path), indent=1))
        os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", str(vllm_config))
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if Path(filename).resolve().is_relative_to(PACKAGE_DIR):
            shown(message, category, filename, lineno, file, line)
        else:
            text = warnings.formatwarning(message, category, filename, lineno, line)
            notices.file.handle(logging.makeLogRecord(
                {"name": "py.warnings", "levelno": logging.WARNING, "levelname": "WARNING",
                 "msg": text.rstrip()}))

    warnings.showwarning = show
    return notices


def vllm_logging_config(path: Path) -> dict:
    """vLLM's logging (``logging.config.dictConfig``) writing its INFO lines and above, in its
    own format, to ``path``."""
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter",
                                    "format": "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] "
                                              "(pid %(process)d) %(message)s",
                                    "datefmt": "%m-%d %H:%M:%S"}},
            "handlers": {"vllm": {"class": "logging.FileHandler", "filename": str(path),
                                  "encoding": "utf-8", "formatter": "vllm", "level": "INFO"}},
            "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}}}


def _loggers_printing_to_the_terminal() -> list[logging.Logger]:
    return [logger for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger) and name.split(".")[0] != PACKAGE
            and any(_to_terminal(h) for h in logger.handlers)]


def _to_terminal(handler: logging.Handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and getattr(handler, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__,
                                                    sys.__stdout__))
