"""Adapters that run kvconnector connectors inside other serving engines.

- :mod:`kvconnector_core.integrations.vllm`: vLLM 0.33 (imports vLLM; load it
  only inside vLLM's own environment).

Importing this package imports no engine.
"""
