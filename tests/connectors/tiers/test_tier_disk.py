"""The secondary-tier contract and the local-disk tier."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from connectors.offload.tiers import DiskTier, TierKey, make_tier
from connectors.offload.tiers.frame import frame_value, unframe_value
from kvconnector_core.errors import ConfigError


def _keys(n: int, group: int = 0, salt: bytes = b"") -> list[TierKey]:
    return [TierKey(bytes([i]) * 31 + salt[:1].ljust(1, b"\0"), group) for i in range(n)]


def _answer(tier, keys, token=None, timeout: float = 30.0) -> int:
    """Poll ``lookup`` the way the connector does, step after step, until it answers."""
    deadline = time.monotonic() + timeout
    while (held := tier.lookup(keys, token)) is None:
        assert time.monotonic() < deadline, "lookup never answered"
        time.sleep(0.001)
    return held


@pytest.fixture
def tier(tmp_path):
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as t:
        yield t


def test_frame_round_trips_and_rejects_damage():
    key, other = _keys(2)
    framed = frame_value(key, b"payload")
    assert unframe_value(key, framed) == b"payload"
    assert unframe_value(other, framed) is None  # stored under another key
    assert unframe_value(key, framed[:-1]) is None  # truncated
    assert unframe_value(key, framed[:-1] + b"X") is None  # corrupted
    assert unframe_value(key, b"junk") is None
    assert unframe_value(key, None) is None


def test_lookup_asks_again_then_answers_the_held_prefix(tier):
    keys = _keys(4)
    assert tier.store([(k, b"v" * 100) for k in keys[:2]])
    assert tier.flush(30)
    assert tier.lookup(keys) is None  # the first call only starts the I/O
    assert _answer(tier, keys) == 2
    assert tier.stats()["disk_lookups"] == 1


def test_store_then_load_returns_the_bytes_and_misses_as_none(tier):
    keys = _keys(3)
    tier.store([(keys[0], b"a" * 10), (keys[1], b"b" * 20)])
    tier.flush(30)
    assert tier.load(keys).values(30) == [b"a" * 10, b"b" * 20, None]
    stats = tier.stats()
    assert (stats["disk_stores"], stats["disk_loads"], stats["disk_load_failures"]) == (2, 2, 1)
    assert stats["disk_bytes_loaded"] == 30


def test_keys_carry_the_group(tier):
    (k0,) = _keys(1, group=0)
    k1 = TierKey(k0.block_hash, 1)
    tier.store([(k0, b"group zero")])
    tier.flush(30)
    assert tier.load([k0, k1]).values(30) == [b"group zero", None]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_file_is_a_failed_load_and_is_removed(tier, damage):
    (key,) = _keys(1)
    tier.store([(key, b"x" * 1000)])
    tier.flush(30)
    path = tier._path(key)
    data = path.read_bytes()
    path.write_bytes(data[:500] if damage == "truncate" else data[:-1] + bytes([data[-1] ^ 1]))
    assert tier.load([key]).values(30) == [None]
    assert not path.exists()
    assert tier.stats()["disk_load_failures"] == 1


def test_size_budget_evicts_least_recently_used(tmp_path):
    keys = _keys(4)
    value = b"v" * 1000
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 3 * 1100}) as tier:
        for k in keys[:3]:
            tier.store([(k, value)])
            tier.flush(30)
        tier.load([keys[0]]).values(30)  # keys[0] is now the most recently used
        tier.store([(keys[3], value)])
        tier.flush(30)
        assert tier.load(keys).values(30) == [value, None, value, value]
        assert tier.bytes_used <= 3 * 1100
        removed = [e for e in tier.take_events() if e.removed]
    assert [e.keys for e in removed] == [(keys[1],)]


def test_store_failure_is_invisible_and_counted(tmp_path, monkeypatch):
    keys = _keys(2)
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as tier:
        def broken_replace(src, dst):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "replace", broken_replace)
        tier.store([(keys[0], b"lost")])
        tier.flush(30)
        monkeypatch.undo()
        assert tier.load([keys[0]]).values(30) == [None]
        assert not any(p.name.startswith(".tmp-") for p in tmp_path.rglob("*"))
        assert tier.stats()["disk_store_failures"] == 1
        assert not tier.take_events()  # a failed store never becomes a stored event


def test_slow_tier_drops_stores_and_never_blocks(tmp_path, monkeypatch):
    gate = threading.Event()
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20,
                   "max_pending_stores": 2, "io_threads": 1}) as tier:
        real_put = tier._put
        monkeypatch.setattr(tier, "_put", lambda items: (gate.wait(), real_put(items)))
        keys = _keys(5)
        accepted = [tier.store([(k, b"v")]) for k in keys]
        assert accepted == [True, True, False, False, False]
        assert tier.stats()["disk_stores_dropped"] == 3
        gate.set()
        tier.flush(30)
        assert _answer(tier, keys) == 2


def test_files_survive_a_restart_in_another_process(tmp_path):
    keys = _keys(3)
    script = (
        "import sys; from connectors.offload.tiers import DiskTier, TierKey\n"
        f"t = DiskTier({{'path': {str(tmp_path)!r}, 'capacity_bytes': 1 << 20}})\n"
        f"t.store([(k, bytes([k.block_hash[0]]) * 64) for k in {keys[:2]!r}])\n"
        "t.flush(30); t.close()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as tier:
        assert tier.bytes_used > 0  # indexed at start, so the budget counts them
        assert _answer(tier, keys) == 2
        assert tier.load(keys[:2]).values(30) == [bytes([0]) * 64, bytes([1]) * 64]


def test_namespaces_do_not_share_files(tmp_path):
    (key,) = _keys(1)
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20, "namespace": "a"}) as a, \
            DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20, "namespace": "b"}) as b:
        a.store([(key, b"tenant a")])
        a.flush(30)
        assert _answer(b, [key]) == 0
        assert b.load([key]).values(30) == [None]


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ({"type": "tape"}, "tier type 'tape' is not known; valid types: disk, redis"),
        ({"type": "disk", "path": "/tmp/x"}, "missing required field `capacity_bytes`"),
        (
            {"type": "disk", "path": "/tmp/x", "capacity_bytes": 0},
            "capacity_bytes must be a positive",
        ),
        (
            {"type": "disk", "path": "/tmp/x", "capacity_bytes": 1, "colour": 1},
            "unknown field `colour`",
        ),
    ],
)
def test_bad_settings_are_config_errors(spec, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")):
        make_tier(spec)


def test_unwritable_path_is_a_config_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot be created"):
        DiskTier({"path": str(Path(blocker) / "sub"), "capacity_bytes": 1})


def test_a_tier_starting_on_a_directory_leaves_live_writers_temp_files(tmp_path):
    """A DiskTier starting on a directory deletes only a crashed writer's stale temp files,
    not every temp file: a TP rank (or an engine) starting while another writes on the same
    directory must not fail that one's store (its rename would find no file)."""
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as first:
        sub = first.root / "ab"
        sub.mkdir()
        live, stale = sub / ".tmp-1-2", sub / ".tmp-3-4"
        live.write_bytes(b"being written")
        stale.write_bytes(b"left by a crash")
        old = time.time() - 3600
        os.utime(stale, (old, old))
        with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}):
            pass
        assert live.exists()
        assert not stale.exists()


def test_a_tier_starting_while_others_rename_and_evict_files_indexes_the_rest(
    tmp_path, monkeypatch
):
    """A file listed by the start-up scan but renamed (a live writer's temp file) or evicted
    (another engine's budget) before it is stat'ed raises no FileNotFoundError out of
    DiskTier() and leaves no directory iterator open, as with 4 TP ranks starting together
    on one directory; here the other writers act between the listing and the stat."""
    import connectors.offload.tiers.disk as disk

    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as first:
        keys = _keys(3)
        first.store([(k, b"value") for k in keys])
        first.flush(30)
        sub = first.root / first._path(keys[0]).parent.name  # noqa: SLF001
        (sub / ".tmp-1-2").write_bytes(b"being written")
    victim = first._path(keys[1])  # noqa: SLF001
    real_scandir = disk.os.scandir

    class Racing:
        """os.scandir whose listed files vanish before the caller stats them."""

        def __init__(self, path):
            self.it = real_scandir(path)
            self.entries = list(self.it)
            for entry in self.entries:
                if entry.name.startswith(".tmp-") or entry.path == str(victim):
                    os.unlink(entry.path)

        def __iter__(self):
            return iter(self.entries)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            self.it.close()

    monkeypatch.setattr(disk.os, "scandir", Racing)
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1 << 20}) as second:
        assert second.bytes_used == 2 * first._path(keys[0]).stat().st_size  # noqa: SLF001


def test_files_that_are_not_tier_keys_are_not_indexed_or_evicted(tmp_path):
    """A ``.kvb`` file whose name is no key name is not the tier's: never counted or evicted."""
    (tmp_path / "default" / "zz").mkdir(parents=True)
    foreign = tmp_path / "default" / "zz" / "notes.kvb"
    foreign.write_bytes(b"x" * 100)
    with DiskTier({"path": str(tmp_path), "capacity_bytes": 1}) as tier:
        assert tier.bytes_used == 0
        tier.store([(_keys(1)[0], b"value")])
        tier.flush(30)
    assert foreign.exists()
