"""pytest plugin of the connector test kit (entry point ``pytest11: kvconnector``).

Installed with kvconnector, so these fixtures exist in every test session:

- ``kv_cache_config``: a tiny one-group full-attention :class:`KVCacheConfig`.
- ``block_pool``: a real GPU ``BlockPool`` with prefix caching.
- ``kv_cache_manager``: a real ``KVCacheManager`` over ``kv_cache_config``.
- ``make_request``: factory ``make_request(num_tokens=..., prompt_token_ids=..., ...)``.
- ``connector_pair``: factory ``connector_pair(config, registry=None) ->
  (scheduler_side, worker_side)``; both are shut down after the test, and a
  ``shutdown()`` that raises fails the test (a :class:`ShutdownError` naming
  every connector that failed, raised once all were shut down).

The kit's modules are imported inside the fixtures, so loading the plugin
costs nothing in sessions that do not use them.

It also ignores torch's "Failed to initialize NumPy" notice: the CPU build of torch comes
without NumPy, which neither kvconnector nor the kit uses, and a session that turns
warnings into errors (``-W error``, ``filterwarnings = ["error"]``) would otherwise fail
at the first import of torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvconnector_core.connector.base import KVConnectorBase_V1
    from kvconnector_core.kv_cache.block_pool import BlockPool
    from kvconnector_core.kv_cache.kv_cache_manager import KVCacheManager
    from kvconnector_core.kv_cache.kv_cache_spec import KVCacheConfig
    from kvconnector_core.request import Request

__all__ = ["block_pool", "connector_pair", "kv_cache_config", "kv_cache_manager", "make_request"]


TORCH_NUMPY_NOTICE = "ignore:Failed to initialize NumPy:UserWarning"
"""The warnings filter the plugin adds (see the module docstring)."""


def pytest_configure(config: pytest.Config) -> None:
    """Ignore torch's notice that the optional NumPy is absent (after the project's filters)."""
    config.addinivalue_line("filterwarnings", TORCH_NUMPY_NOTICE)


@pytest.fixture
def kv_cache_config() -> KVCacheConfig:
    """A tiny one-group full-attention KV cache config (block size 4, 32 blocks, 2 layers)."""
    from kvconnector_core.testing.factories import make_kv_cache_config

    return make_kv_cache_config()


@pytest.fixture
def block_pool() -> BlockPool:
    """A real GPU block pool with prefix caching (32 blocks of 4 tokens)."""
    from kvconnector_core.testing.factories import make_block_pool

    return make_block_pool()


@pytest.fixture
def kv_cache_manager(kv_cache_config: KVCacheConfig) -> KVCacheManager:
    """A real KV cache manager over ``kv_cache_config``."""
    from kvconnector_core.testing.factories import make_kv_cache_manager

    return make_kv_cache_manager(kv_cache_config)


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """Factory of hashed requests (see ``kvconnector_core.testing.make_request``)."""
    from kvconnector_core.testing.factories import make_request as factory

    return factory


@pytest.fixture
def connector_pair(kv_cache_config: KVCacheConfig
                   ) -> Iterator[Callable[..., tuple[KVConnectorBase_V1, KVConnectorBase_V1]]]:
    """Factory ``connector_pair(config, registry=None)`` -> ``(scheduler_side, worker_side)``."""
    from kvconnector_core.testing.factories import make_connector_pair

    created: list[KVConnectorBase_V1] = []

    def factory(config: Any, registry: Any = None) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
        pair = make_connector_pair(config, kv_cache_config, registry=registry)
        created.extend(pair)
        return pair

    yield factory
    from kvconnector_core.errors import ShutdownError

    failures: list[tuple[str, BaseException]] = []
    for conn in created:
        try:
            conn.shutdown()
        except Exception as exc:  # noqa: BLE001 - shut the others down first, then report every failure
            failures.append((f"{type(conn).__name__} ({conn.role.name.lower()} side)", exc))
    if failures:
        raise ShutdownError(failures)
