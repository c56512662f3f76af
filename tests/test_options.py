"""The options object and the environment variables behind it."""
import pytest

import commlib
from commlib.base.options import Options


def test_unknown_option_is_rejected():
    with pytest.raises(AttributeError, match="unknown commlib option 'timout'"):
        commlib.options.timout = 3
    with pytest.raises(AttributeError, match="known options"):
        commlib.options.nope
    with pytest.raises(TypeError, match="unknown commlib option"):
        commlib.init(chek=True)


def test_environment_is_parsed():
    opts = Options({"COMMLIB_CHECK": "yes", "COMMLIB_TIMEOUT": "2.5", "COMMLIB_LOCAL_SIZE": "2",
                    "COMMLIB_CUDA_AWARE": "0"})
    assert opts.check is True and opts.timeout == 2.5 and opts.local_size == 2
    assert opts.cuda_aware == "0"


def test_bad_environment_names_the_variable():
    with pytest.raises(ValueError, match="COMMLIB_TIMEOUT='soon'"):
        Options({"COMMLIB_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="COMMLIB_LOCAL_SIZE"):
        Options({"COMMLIB_LOCAL_SIZE": "0"})


def test_unknown_environment_variable_warns():
    with pytest.warns(UserWarning, match="COMMLIB_CHEK"):
        Options({"COMMLIB_CHEK": "1"})


def test_values_are_validated(monkeypatch):
    with pytest.raises(ValueError, match="option 'timeout'"):
        commlib.options.timeout = -1
    monkeypatch.setattr(commlib.options, "check", "1")
    assert commlib.options.check is True


def test_init_is_idempotent():
    a = commlib.init()
    assert commlib.init() is a
    assert commlib.is_initialized()
