"""The KV cache core: hashing, block pool, specs, single-type managers, coordinator, manager."""
