"""The benchmarks' shared harness (bench/common.py, bench/servers.py) on real processes and real tables."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import cpu_by_process, cpu_snapshot, cpu_table, percentile, process_label, rows_table, tagged_pids
from bench.servers import RUN_ID, start, sweep_leftovers

BUSY = "import time\nt = time.time()\nwhile time.time() - t < 60: pass\n"


def test_a_started_server_is_counted_and_stopped(tmp_path: Path) -> None:
    """A process started by bench/servers.py is found by session and tag, its CPU time is counted under its
    label, and stop() leaves nothing of it behind."""
    server = start("busy", [sys.executable, "-c", BUSY], {}, tmp_path / "busy.log", "http://127.0.0.1:1")
    try:
        time.sleep(0.5)
        pids = server.pids()
        assert server.proc.pid in pids
        assert server.proc.pid in tagged_pids(server.tag)
        before = cpu_snapshot(pids)
        time.sleep(1.0)
        used = cpu_by_process(before, cpu_snapshot(server.pids()))
        label = process_label(server.proc.pid)
        assert used.get(label, 0.0) > 0.1, used  # a busy loop uses most of a core over one second
    finally:
        server.stop(grace_s=2.0)
    assert not server.alive() and not server.pids()
    assert sweep_leftovers() == [] and not tagged_pids(RUN_ID, prefix=True)


def test_percentile_interpolates_and_is_none_when_empty() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0], 100) == 4.0


def test_tables_keep_their_shape() -> None:
    """The markdown docs/benchmarks.md quotes: rows_table's rules, and cpu_table's rows per system with small
    labels folded into "other"."""
    assert rows_table([{"a": 1.5, "b": "x"}], ["a", "b"]) == "| a | b |\n| --- | --- |\n| 1.50 | x |"
    run = {"cpu_seconds": {"engine": 9.0, "proxy": 1.0, "agent": 0.04}, "cpu_window_s": 10.0,
           "total_output_tokens": 1000, "client_cpu_s": 0.5}
    assert cpu_table({"plain": run, "ours": None}, min_share=0.01).splitlines() == [
        "| system | process | CPU s | of one core | CPU ms per output token |",
        "|---|---|---|---|---|",
        "| plain | **all 3 labels** | 10.04 | 100% | 10.040 |",
        "| plain | engine | 9.00 | 90% | 9.000 |",
        "| plain | proxy | 1.00 | 10% | 1.000 |",
        "| plain | other (1 labels) | 0.04 | 0% | 0.040 |",
        "| plain | (benchmark client, not in the total) | 0.50 | 5% | 0.500 |",
    ]


def test_rounds_run_apart_merge_into_medians_and_the_goals_name_a_round_that_missed(tmp_path: Path) -> None:
    """bench/serving.py run one round per invocation: --merge reads their JSON files back as one run."""
    import json

    from bench.serving import combine
    from bench.serving_report import goals, merge

    def run(rnd: int, reqs: float, ttft: float, itl: float) -> dict:
        return {"round": rnd, "request_throughput": reqs, "median_ttft_ms": ttft, "median_itl_ms": itl,
                "completed": 100, "failed": 0}

    files = []
    for rnd, ours, rayllm, plain in ((0, (30.0, 1200.0, 9.0), (28.0, 1300.0, 9.5), (34.0, 1000.0)),
                                     (1, (32.0, 1100.0, 0.002), (30.0, 1500.0, 10.0), (36.0, 900.0))):
        doc = {"setup": {"rounds": 1, "systems": ["plain", "ours", "rayllm"], "date": str(rnd)},
               "results": {"ours": {"rates": {"inf": run(rnd, *ours), "first": run(rnd, 20.0, 2000.0, 8.0)},
                                    "replay": {"round": rnd, "ttft_p50_ms": 150.0 + rnd, "ttft_p99_ms": 600.0}},
                           "rayllm": {"rates": {"inf": run(rnd, *rayllm)},
                                      "replay": {"round": rnd, "ttft_p50_ms": 180.0, "ttft_p99_ms": 700.0}},
                           "plain": {"rates": {"inf": run(rnd, *plain, 8.0)},
                                     "replay": {"round": rnd, "ttft_p50_ms": 110.0, "ttft_p99_ms": 500.0}}}}
        files.append(tmp_path / f"r{rnd}.json")
        files[-1].write_text(json.dumps(doc))
    results, setup = merge([str(f) for f in files], combine)
    assert setup["rounds"] == 2 and len(setup["parts"]) == 2
    inf = results["ours"]["rates"]["inf"]
    assert inf["request_throughput"] == 31.0 and inf["completed"] == 200 and "round" not in inf
    assert [r["round"] for r in inf["repeats"]] == [0, 1]
    assert results["ours"]["replay"]["ttft_p50_ms"] == 150.5
    lines = goals(results)
    assert any(line.startswith("- Burst req/s, ours/rayllm = 1.07") and line.endswith("met") for line in lines)
    itl = next(line for line in lines if line.startswith("- ITL p50 of ours"))
    assert "MISSED" in itl and "inf round 1" in itl and "first" not in itl.split("MISSED")[1]
