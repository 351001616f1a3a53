"""Without vLLM: the vLLM rig's import and ``kvconnector vllm-check`` name the install
command (one line, exit 2), input errors are found before vLLM is needed, and nothing else
in the kit needs vLLM."""

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


@pytest.mark.parametrize(("argv", "bad"), [
    (["--kv-transfer-config", '{"kv_connector": '], "not valid JSON"),
    (["--kv-transfer-config", '{"kv_connector": "KVConnectorAdapter"}', "--layouts", "XYZ"],
     "'XYZ'"),
    (["--kv-transfer-config", '{"kv_connector": "KVConnectorAdaptor", '
      '"kv_connector_module_path": "kvconnector_core.integrations.vllm"}'], "KVConnectorAdaptor"),
    (["--kv-transfer-config", '{"kv_connector": "KVConnectorAdapter", '
      '"kv_connector_extra_config": {"kvconnector": {"name": "cpu_ofload"}}}'],
     "did you mean 'cpu_offload'"),
], ids=["json", "layout", "adapter-class", "kvconnector-connector"])
def test_input_errors_are_reported_before_vllm_is_needed(argv, bad, capsys):
    """A malformed config or layout is named (importing vLLM would print its own notices
    first), not reported as vLLM missing."""
    assert main(["vllm-check", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad in err[0] and "requires vLLM" not in err[0], err


def test_the_kit_imports_without_vllm():
    from kvconnector_core.testing import ConnectorContract, DataCheck

    assert DataCheck.engine == "kvconnector" and ConnectorContract.engine == "kvconnector"
