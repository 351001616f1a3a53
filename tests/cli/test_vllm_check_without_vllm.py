"""Without vLLM: the vLLM rig's import and ``kvconnector vllm-check`` name the install
command (one line, exit 2), and nothing else in the kit needs vLLM."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is not None:
    pytest.skip("vLLM is installed here (the vLLM suite covers the rig)", allow_module_level=True)

from kvconnector_core.cli import main


def test_importing_the_rig_names_the_install_command():
    with pytest.raises(ImportError, match=r"requires vLLM 0\.33: .*make vllm-venv") as info:
        import kvconnector_core.testing.vllm  # noqa: F401
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_vllm_check_without_vllm_is_one_line_and_exit_2(capsys):
    config = '{"kv_connector": "KVConnectorAdapter", "kv_role": "kv_both"}'
    assert main(["vllm-check", "--kv-transfer-config", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm-check requires vLLM 0.33" in err[0], err


def test_the_kit_imports_without_vllm():
    from kvconnector_core.testing import ConnectorContract, DataCheck

    assert DataCheck.engine == "kvconnector" and ConnectorContract.engine == "kvconnector"
