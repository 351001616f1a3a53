"""Engine: workloads (traces), the Engine itself (engine) and reports (report). Import the
submodules; this package imports nothing (torch is heavy)."""

__all__: list[str] = []
