"""Run kvconnector connectors inside vLLM 0.33.

vLLM loads :class:`KVConnectorAdapter` through its standard connector config::

    --kv-transfer-config '{"kv_connector": "KVConnectorAdapter",
      "kv_connector_module_path": "kvconnector_core.integrations.vllm",
      "kv_role": "kv_both",
      "kv_connector_extra_config": {"kvconnector": {"name": "cpu_offload",
                                                     "extra_config": {"num_cpu_blocks": 4096}}}}'

``kvconnector.name`` is any name kvconnector's registry knows (built-ins,
aliases and third-party entry points). See ``docs/vllm.md``.

Why here: the adapter is a layer above the connector API (it imports both vLLM
and kvconnector's public connector API, and nothing imports it), so it lives in
``kvconnector_core.integrations``, next to nothing engine-specific; importing
this module imports vLLM, so only vLLM's environment imports it.

The package's modules, one object each, as in every connector package of the project:
``connector`` (the adapter vLLM creates, the facade), ``scheduler`` (its scheduler-role
object), ``worker`` (its worker-role object), ``config`` (vLLM's configs translated),
``records`` (what crosses between the roles and the vLLM boundary), ``views`` (vLLM's
scheduler objects in kvconnector's shapes), ``layouts`` (vLLM's KV tensors as block-dense
views) and ``cpu_config`` (a CPU ``VllmConfig`` for tests and benchmarks).

Primitives: :class:`KVConnectorAdapter`, :class:`KVConnectorAdapterHMA`,
:class:`AdapterStats`, :func:`block_dense_views`.
"""

from __future__ import annotations

from kvconnector_core.integrations.vllm.connector import KVConnectorAdapter, KVConnectorAdapterHMA
from kvconnector_core.integrations.vllm.layouts import block_dense_views
from kvconnector_core.integrations.vllm.records import AdapterStats

__all__ = ["AdapterStats", "KVConnectorAdapter", "KVConnectorAdapterHMA", "block_dense_views"]
