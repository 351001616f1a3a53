"""The connector test kit checks what it claims: hook order, idempotent shutdown, fixture teardown,
and its five pytest fixtures work."""

from __future__ import annotations

import subprocess
import re
import sys
import textwrap

import pytest

from kvconnector_core.connector import ConnectorRegistry, KVConnectorConfig, KVConnectorRole
from kvconnector_core.errors import InvariantError
from kvconnector_core.kv_events import AllBlocksCleared, BlockStored
from kvconnector_core.testing import (
    WORKER_STEP_HOOKS,
    ConnectorContract,
    FaultInjectingConnector,
    InjectedFault,
    RecordingConnector,
    check_hook_order,
)

# -- hook order ------------------------------------------------------------------------------------


def test_check_hook_order_names_the_first_hook_out_of_place():
    """Two hooks swapped, one missing, one extra: each is an AssertionError naming it."""
    check_hook_order(list(WORKER_STEP_HOOKS), WORKER_STEP_HOOKS)
    swapped = list(WORKER_STEP_HOOKS)
    swapped[3], swapped[4] = swapped[4], swapped[3]
    with pytest.raises(
        AssertionError, match="call 3: got 'get_transfer_results'.*wants 'wait_for_save'"
    ):
        check_hook_order(swapped, WORKER_STEP_HOOKS)
    with pytest.raises(AssertionError, match="8 hook calls where the reference order has 9"):
        check_hook_order(WORKER_STEP_HOOKS[:-1], WORKER_STEP_HOOKS)
    with pytest.raises(AssertionError, match="10 hook calls"):
        check_hook_order([*WORKER_STEP_HOOKS, "wait_for_save"], WORKER_STEP_HOOKS)


def test_reference_order_matches_the_documented_one():
    """The kit's order is the one KVConnectorBase_V1 documents for a step without a forward."""
    from kvconnector_core.connector.base import KVConnectorBase_V1

    doc = " ".join(KVConnectorBase_V1.__doc__.split())
    documented = [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_save",
        "get_transfer_results",
        "get_block_ids_with_load_errors",
        "get_kv_connector_stats",
        "build_connector_worker_meta",
        "clear_connector_metadata",
    ]
    assert [doc.index(f"``{h}``") for h in documented] == sorted(
        doc.index(f"``{h}``") for h in documented
    )
    assert [h for h in WORKER_STEP_HOOKS if h != "handle_preemptions"] == documented
    assert "``handle_preemptions`` runs right after ``bind_connector_metadata``" in doc


# -- idempotent shutdown ---------------------------------------------------------------------------


class DoubleRelease(RecordingConnector):
    """Pins a cached block on every admission and releases its pins at every shutdown,
    without forgetting them: a second shutdown releases them again."""

    name = "DoubleRelease"

    def bind_gpu_block_pool(self, gpu_block_pool):
        super().bind_gpu_block_pool(gpu_block_pool)
        self._pool, self._pinned = gpu_block_pool, []

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        cached = list(self._pool.iter_cached_blocks())[:1]
        self._pool.touch(cached)
        self._pinned += cached

    def shutdown(self):
        super().shutdown()
        if getattr(self, "_pool", None) is not None:
            self._pool.free_blocks(self._pinned)


def test_idempotent_shutdown_check_catches_a_double_release():
    """The kit's idempotent-shutdown test fails for a connector whose second shutdown releases
    again."""
    registry = ConnectorRegistry()
    registry.add(DoubleRelease)

    class Broken(ConnectorContract):
        connector_config = KVConnectorConfig(name="DoubleRelease")

    Broken.registry = registry
    with pytest.raises(
        AssertionError, match="the second shutdown raised InvariantError: freeing"
    ) as info:
        Broken().test_shutdown_is_idempotent()
    assert isinstance(info.value.__cause__, InvariantError)


# -- fault injection of the snapshot hook ----------------------------------------------------------


class Snapshotting(RecordingConnector):
    """Reports one medium and holds one block in it."""

    name = "Snapshotting"

    def get_event_snapshot(self):
        return [
            AllBlocksCleared(medium="CPU"),
            BlockStored(
                block_hashes=[1],
                parent_block_hash=None,
                token_ids=[],
                block_size=4,
                lora_id=None,
                medium="CPU",
                lora_name=None,
            ),
        ]


def test_fault_injection_forwards_and_raises_in_get_event_snapshot():
    """The wrapper forwards the inner snapshot, and raise_in={"get_event_snapshot"} raises there."""
    inner = Snapshotting(KVConnectorConfig(name="Snapshotting"), KVConnectorRole.SCHEDULER)
    assert list(FaultInjectingConnector(inner).get_event_snapshot()) == list(
        inner.get_event_snapshot()
    )
    with pytest.raises(InjectedFault):
        FaultInjectingConnector(inner, raise_in={"get_event_snapshot"}).get_event_snapshot()


def test_contract_checks_the_snapshot_shape():
    """The kit's snapshot check fails for a snapshot whose blocks come before their medium's
    clear."""

    class Unordered(Snapshotting):
        name = "Unordered"

        def get_event_snapshot(self):
            return list(reversed(super().get_event_snapshot()))

    registry = ConnectorRegistry()
    registry.add(Snapshotting)
    registry.add(Unordered)

    class Good(ConnectorContract):
        connector_config = KVConnectorConfig(name="Snapshotting")

    class Bad(ConnectorContract):
        connector_config = KVConnectorConfig(name="Unordered")

    Good.registry = Bad.registry = registry
    Good().test_event_snapshot_is_well_formed()
    with pytest.raises(
        AssertionError, match="BlockStored for medium 'CPU' before AllBlocksCleared"
    ):
        Bad().test_event_snapshot_is_well_formed()


# -- the pytest plugin's fixtures ------------------------------------------------------------------


def test_kv_cache_config_fixture(kv_cache_config):
    """One full-attention group of two layers with 4-token blocks."""
    (group,) = kv_cache_config.kv_cache_groups
    assert group.layer_names == ["layer.0", "layer.1"] and group.kv_cache_spec.block_size == 4
    assert kv_cache_config.num_blocks == 32


def test_block_pool_fixture(block_pool):
    """A real pool: every block but the null block is free, and allocation takes them."""
    assert block_pool.get_num_free_blocks() == block_pool.num_gpu_blocks - 1
    blocks = block_pool.get_new_blocks(3)
    assert block_pool.get_num_free_blocks() == block_pool.num_gpu_blocks - 4
    block_pool.free_blocks(blocks)
    assert block_pool.get_num_free_blocks() == block_pool.num_gpu_blocks - 1


def test_kv_cache_manager_and_make_request_fixtures(kv_cache_manager, make_request):
    """A second request with the same prompt hits the first one's cached full blocks."""
    prompt = list(range(13))
    first = make_request(prompt_token_ids=prompt)
    assert len(first.block_hashes) == 3
    assert kv_cache_manager.allocate_slots(first, first.num_tokens) is not None
    kv_cache_manager.cache_blocks(first, first.num_tokens)
    _, hit = kv_cache_manager.get_computed_blocks(make_request(prompt_token_ids=prompt))
    assert hit == 12


def test_connector_pair_fixture(connector_pair):
    """The factory builds both roles of a connector from its config."""
    registry = ConnectorRegistry()
    registry.add(RecordingConnector)
    sched, worker = connector_pair(KVConnectorConfig(name="RecordingConnector"), registry=registry)
    assert isinstance(sched, RecordingConnector) and isinstance(worker, RecordingConnector)
    assert (sched.role, worker.role) == (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)


def test_connector_pair_fixture_reports_a_failing_shutdown(tmp_path):
    """A shutdown() that raises fails the test at teardown (it is not swallowed), after the
    other connectors were shut down."""
    test = tmp_path / "test_failing_shutdown.py"
    test.write_text(
        textwrap.dedent("""
        from kvconnector_core.connector import ConnectorRegistry, KVConnectorConfig
        from kvconnector_core.testing import RecordingConnector

        SHUT = []

        class BadShutdown(RecordingConnector):
            name = "BadShutdown"

            def shutdown(self):
                SHUT.append(self.role.name)
                if self.role.name == "SCHEDULER":
                    raise RuntimeError("shutdown exploded")

        def test_uses_pair(connector_pair):
            registry = ConnectorRegistry()
            registry.add(BadShutdown)
            connector_pair(KVConnectorConfig(name="BadShutdown"), registry=registry)

        def test_after():
            assert SHUT == ["SCHEDULER", "WORKER"]
    """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # The test body passes; its teardown errors (torch may add its NumPy notice as a warning).
    assert re.search(r"2 passed, (1 warning, )?1 error", out), out
    assert "1 connector(s) failed to shut down" in out and "BadShutdown (scheduler side)" in out
    assert "shutdown exploded" in out


def test_plugin_import_is_cheap_and_a_warnings_as_errors_session_runs_the_kit(tmp_path):
    """Stranger log (docs16): loading the kit's pytest plugin imported kvconnector_core.testing,
    which imported torch and the engine in every pytest session; with the common
    ``filterwarnings = ["error"]``, torch's "Failed to initialize NumPy" notice then failed a
    connector author's session before any test ran. The package's names now load on first
    use and the plugin ignores that one notice."""
    code = (
        "import sys, kvconnector_core.testing.plugin; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    (tmp_path / "test_author.py").write_text(
        "from kvconnector_core.testing import make_kv_cache_config\n\n\n"
        "def test_kit_works():\n    assert make_kv_cache_config().kv_cache_groups\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
