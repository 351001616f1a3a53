"""Fault-injection sweep: seeded engine runs under faults, every damage check expected at 0.

For every seed in the range, the seed's workload runs once without a connector (the
baseline) and then once per (connector, fault) cell; see ``_fault_runs.py`` for the
connectors, the faults and the checks. Prints one row per cell (runs, runs failing each
check, the smallest failing seed with its checks) and a total; exits 1 when any run failed
a check.

    python benchmarks/fault_sweep.py                      # seeds 0-133: 2,010 runs
    python benchmarks/fault_sweep.py --seeds 0:3          # the quick subset CI runs
    python benchmarks/fault_sweep.py --connectors memory --faults raise_once --seeds 40:41 -v
    python benchmarks/fault_sweep.py --json /tmp/sweep.json --record benchmarks/RESULTS.md --label "after"

Reproduce one failing run: ``--seeds S:S+1 --connectors C --faults F -v`` prints its details.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy: harmless

import msgspec  # noqa: E402

from _drivers import machine_info, record_section  # noqa: E402
from _fault_runs import CHECKS, CONNECTORS, FAULTS, RunOutcome, baseline_outputs, run_cell  # noqa: E402

__all__ = ["main", "summarize", "summarize_hooks", "sweep"]


def sweep(seeds: range, connectors: tuple[str, ...] = CONNECTORS, faults: tuple[str, ...] = FAULTS,
          verbose: bool = False) -> list[RunOutcome]:
    """Run every cell for every seed (one baseline per seed)."""
    outcomes = []
    for i, seed in enumerate(seeds):
        if verbose or (i and i % 20 == 0):
            print(f"seed {seed} ({i}/{len(seeds)} done)", file=sys.stderr, flush=True)
        baseline = baseline_outputs(seed)
        for connector in connectors:
            for fault in faults:
                outcome = run_cell(connector, fault, seed, baseline)
                outcomes.append(outcome)
                if verbose and (outcome.failed or outcome.detail):
                    print(f"seed {seed} {connector}/{fault}: {outcome.failed} {outcome.detail}", file=sys.stderr)
    return outcomes


def summarize(outcomes: list[RunOutcome]) -> str:
    """The Markdown table: per cell, runs failing each check, and the smallest failing seed."""
    cells: dict[tuple[str, str], list[RunOutcome]] = defaultdict(list)
    for o in outcomes:
        cells[(o.connector, o.fault)].append(o)
    head = ["connector", "fault", "runs", "not started", *CHECKS, "failing runs", "smallest failing seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals: dict[str, int] = defaultdict(int)
    for (connector, fault), runs in cells.items():
        per_check = {c: sum(1 for o in runs if o.counts.get(c)) for c in CHECKS}
        failing = [o for o in runs if o.failed]
        first = min(failing, key=lambda o: o.seed) if failing else None
        row = [connector, fault, len(runs), sum(1 for o in runs if not o.started),
               *per_check.values(), len(failing),
               f"{first.seed} ({', '.join(first.failed)})" if first else "-"]
        lines.append("| " + " | ".join(str(v) for v in row) + " |")
        totals["runs"] += len(runs)
        totals["not started"] += row[3]
        for c in CHECKS:
            totals[c] += per_check[c]
        totals["failing"] += len(failing)
    lines.append("| **total** | | " + " | ".join(
        str(totals[k]) for k in ("runs", "not started", *CHECKS, "failing")) + " | |")
    return "\n".join(lines)


def summarize_hooks(outcomes: list[RunOutcome]) -> str:
    """Per hook, over the single-hook faults (``hook_10pct``, ``raise_once``): runs, failing
    runs, and the smallest failing run."""
    rows: dict[tuple[str, str], list[RunOutcome]] = defaultdict(list)
    for o in outcomes:
        for hook in {h.split(".", 1)[1].split("@")[0] for h in o.hooks}:
            rows[(o.fault, hook)].append(o)
    lines = ["| fault | hook | runs | failing runs | smallest failing run |", "|---|---|---|---|---|"]
    for (fault, hook), runs in sorted(rows.items()):
        failing = [o for o in runs if o.failed]
        first = min(failing, key=lambda o: o.seed) if failing else None
        where = (f"seed {first.seed} {first.connector} ({', '.join(first.failed)})" if first else "-")
        lines.append(f"| {fault} | {hook} | {len(runs)} | {len(failing)} | {where} |")
    return "\n".join(lines)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parent)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns 1 when a run failed a check."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:134", help="START:STOP (STOP excluded); default 0:134")
    parser.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=list(CONNECTORS))
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failing run's details")
    parser.add_argument("--json", help="write every run's outcome to this file")
    parser.add_argument("--record", help="append the table to this RESULTS.md (section 'Fault sweep', headed LABEL)")
    parser.add_argument("--label", default="run", help="section label for --record")
    args = parser.parse_args(argv)
    start, _, stop = args.seeds.partition(":")
    seeds = range(int(start), int(stop) if stop else int(start) + 1)
    import torch  # one thread: runs are tiny, and the machine is shared

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    outcomes = sweep(seeds, tuple(args.connectors), tuple(args.faults), args.verbose)
    wall = time.perf_counter() - t0
    table = summarize(outcomes)
    hooks = summarize_hooks(outcomes)
    info = machine_info()
    footer = (f"{len(outcomes)} runs, seeds {seeds.start}-{seeds.stop - 1}, {wall:.0f} s on "
              f"{info.get('cpu', 'unknown CPU')} (1 thread), commit {_commit()}")
    print(table)
    print()
    print(hooks)
    print(footer)
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(outcomes))
    if args.record:
        record_section(Path(args.record), "## Fault sweep (fault_sweep.py)", f"### {args.label}\n\n{table}\n\n{footer}\n\nPer hook:\n\n{hooks}\n")
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
