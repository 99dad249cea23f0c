"""`make test`: the suite's two lanes at once, the cluster lane at idle priority (docs/testing.md, "Two lanes").

The apps lane (``pytest --lane apps``: the unit tests and every test of a Serve app) runs in the foreground as a
plain ``pytest`` would. The cluster lane (``--lane cluster``: offline jobs, Ray Train jobs, pipeline stages, the
two-node cluster; each test needs at most a Ray cluster, which the lane starts for itself) runs beside it under
Linux's ``SCHED_IDLE`` policy, which every process it starts inherits: it takes only the CPU the apps lane leaves
idle, so the apps lane's latency tests measure what they measured alone. Its output follows the apps lane's.

``python -m tests.lanes [pytest arguments]``: the arguments go to both lanes (paths, ``-k``, ``-x``...). The exit
status is the first lane's failure, else 0; a lane the arguments leave without tests is not a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NO_TESTS = 5  # pytest's exit status when a selection collects nothing
UNIT_TESTS = Path(__file__).resolve().parent / "unit"


def _idle_priority() -> None:
    """In the cluster lane's child, before pytest starts: SCHED_IDLE, which its children inherit (the lowest
    niceness where a system has no such policy)."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def main(argv: list[str]) -> int:
    work = Path(tempfile.mkdtemp(prefix="coserve-lanes-"))
    log_path = work / "cluster-lane.log"
    pytest = [sys.executable, "-m", "pytest"]
    try:
        with open(log_path, "wb") as log:
            cluster = subprocess.Popen(
                # A base temp of its own: two pytest processes must not number (and prune) the same directories.
                # The unit tests are all the apps lane's: not collecting them here spares this lane importing
                # vLLM's and the learning routes' test modules (collection 20 -> 11 s).
                [
                    *pytest,
                    "--lane=cluster",
                    f"--basetemp={work / 'tmp'}",
                    "-p",
                    "no:cacheprovider",
                    f"--ignore={UNIT_TESTS}",
                    *argv,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_idle_priority,
            )
            foreground = subprocess.Popen([*pytest, "--lane=apps", *argv])
            try:
                apps = foreground.wait()
            except KeyboardInterrupt:  # the terminal's Ctrl-C reached both lanes: let each stop its Ray cluster
                for lane in (foreground, cluster):
                    try:
                        lane.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        lane.terminate()
                raise
            if cluster.poll() is None:
                print("\n== the apps lane is done; waiting for the cluster lane ==", flush=True)
            cluster_rc = cluster.wait()
        print("\n== the cluster lane (ran beside the apps lane, at idle priority) ==", flush=True)
        sys.stdout.write(log_path.read_text(errors="replace"))
        sys.stdout.flush()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return combined_status([apps, cluster_rc])


def combined_status(codes: list[int]) -> int:
    """The lanes' pytest exit statuses as one: the first failure; else 0, unless no lane collected a test."""
    failed = [c for c in codes if c not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
