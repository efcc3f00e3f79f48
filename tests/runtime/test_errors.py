"""A user's mistake is one line and exit 2; the traceback only with DGPO_DEBUG=1."""

import pytest

from megatron_dgpo.runtime.config import ConfigError
from megatron_dgpo.runtime.errors import EXIT_INPUT_ERROR, InputError, reported_as


@reported_as("dgpo-x")
def _main(error):
    raise error


def test_input_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DGPO_DEBUG", raising=False)
    assert _main(ConfigError("train.steps must be >= 1, got 0")) == EXIT_INPUT_ERROR == 2
    err = capsys.readouterr().err
    assert err == "dgpo-x: error: train.steps must be >= 1, got 0\n"
    monkeypatch.setenv("DGPO_DEBUG", "1")
    assert _main(InputError("data.path: no such file")) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.endswith("dgpo-x: error: data.path: no such file\n")


def test_other_errors_are_not_input_errors():
    with pytest.raises(RuntimeError):
        _main(RuntimeError("a bug"))
