"""Shared fixtures: one Ray cluster and one Serve app (two nodes, embedded model) per test session.

Unit tests never touch these fixtures, so `pytest tests/unit` runs without Ray or torch.
The app runs as `make serve` runs it: HAProxy in front of model servers that answer HTTP
themselves (app/serve_env.py), set here before anything imports Ray Serve.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from app import serve_env
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


serve_env.apply()
# HAProxy's stats and metrics ports and Serve's fallback proxy are fixed by default: ports of its
# own, so the suite runs beside a `make serve` (or another suite) on the same machine.
for _var in (
    "RAY_SERVE_HAPROXY_STATS_PORT",
    "RAY_SERVE_HAPROXY_METRICS_PORT",
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
):
    os.environ.setdefault(_var, str(free_port()))
# Ray's log monitor globs the session's log directory for new files every 0.1 s while it holds fewer than 1,000
# (0.85% of a core for an idle cluster, 0.27% with these; about 2.4% over a suite run). The suite reads no
# worker's output through a driver (log_to_driver is off), so it looks every 5 s. The Ray processes the suite
# starts (its clusters, `ray start`, the CLIs' own) inherit this environment.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")
# A raylet keeps up to num_cpus (8 here) idle worker processes for later tasks; each idle one takes about 0.6% of a
# core (its main thread checks for signals every 10 ms), and over a run the suite's clusters gathered 17 of them.
# Two are kept; a task beyond them starts a process as it would on a cluster's first task.
os.environ.setdefault("RAY_num_workers_soft_limit", "2")
# vLLM reports usage statistics from every engine it starts: a thread that runs py-cpuinfo in a child interpreter
# (0.5 CPU-seconds, measured) and then posts to vLLM's server. A test run sends nothing anywhere, and the suite starts
# about 40 engines.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("coserve-data")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from tests.helpers import smollm2_cache

    return smollm2_cache()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (only the project's own CI has it)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread in the test process: faster and steadier on a shared 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # The dashboard serves Ray's state API, which the placement tests read. address="local": a
    # cluster of the suite's own, even beside a running `make serve` or another suite's.
    serve_env.init_ray(address="local", dashboard_port=free_port())
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def app_config(data_dir) -> dict:
    return {
        "name": "coserve-test",
        "data_dir": str(data_dir),
        "cluster": {"nodes": 2, "stages": 1, "bundle": {"CPU": 1}},
        "model": {"embedded": "tiny-llama", "max_model_len": 1024},
        "engine": {"max_num_seqs": 16, "kv_cache_memory_bytes": 128 * 2**20},
        # Round robin makes per-node counts exact in tests; test_placement_live.py switches to lemix.
        "planner": {"placement": "round_robin"},
        # The random tiny model has no answers worth keeping: the gate's retention check is off by default here
        # and on where a test asks for it (tests/integration/test_gate.py).
        "training": {"gate": {"retention": False}},
    }


@pytest.fixture(scope="session")
def app_pool(ray_cluster, tmp_path_factory):
    """The apps test modules start beside the session app (tests/app_pool.py), behind the session's HTTP port."""
    from ray import serve

    from tests.app_pool import AppPool

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield AppPool(f"http://127.0.0.1:{port}", lambda name: tmp_path_factory.mktemp(f"{name}-data"))
    # No serve.shutdown(): its graceful stop of every replica took 12 s, and ray_cluster's ray.shutdown() then ends
    # the cluster as a whole (measured: no HAProxy, Ray or vLLM process outlives it).


@pytest.fixture(scope="module")
def tenants_app(request, app_url, app_pool):
    """The tenants app (tests/tenants_app.py), one for the modules that use this fixture: deployed for the first,
    removed after the last of them in this session."""
    from tests.tenants_app import APP, used_later

    yield app_pool.serve(APP)
    if not used_later(request, "tenants_app"):
        app_pool.remove(APP.name)


def _uses_the_session_app(item: pytest.Item) -> bool:
    return "app_url" in getattr(item, "fixturenames", ())


LANES = ("all", "apps", "cluster")


def pytest_addoption(parser):
    parser.addoption(
        "--lane",
        choices=LANES,
        default="all",
        help="run one lane of the suite: 'apps' (the unit tests and every test of the session app or an app beside it), "
        "'cluster' (the rest: their own Ray cluster, no Serve app); `make test` runs both at once (tests/lanes.py)",
    )


def _is_unit(item: pytest.Item) -> bool:
    return ROOT / "tests" / "unit" in Path(item.path).resolve().parents


def lane_of(item: pytest.Item) -> str:
    """'apps' for the unit tests, the tests of the Serve apps (they share the session app and its cluster, and
    measure latency) and the tests marked ``foreground`` (they time this machine); 'cluster' for the rest: each
    needs at most a Ray cluster of its own."""
    foreground = _is_unit(item) or _uses_the_session_app(item) or item.get_closest_marker("foreground") is not None
    return "apps" if foreground else "cluster"


def pytest_collection_modifyitems(config, items):
    """The unit tests first: they start no Ray, so they run while the session app's replicas start
    (``_early_apps``) instead of after the rest (measured in docs/testing.md). ``--lane`` keeps one lane's tests."""
    items.sort(key=lambda item: 0 if _is_unit(item) else 1)  # stable: order kept within
    lane = config.getoption("--lane")
    if lane == "all":
        return
    kept, left = [], []
    for item in items:
        (kept if lane_of(item) == lane else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _early_apps(request):
    """Begin deploying the session app before the first test when any selected test uses it (``pytest tests/unit``
    starts no Ray), and the secured app beside it when its package is selected: its tests run first after the unit
    tests. A replica spends about 25 s in process starts and imports, mostly on one core: the unit tests fill the
    other meanwhile (docs/testing.md)."""
    items = request.session.items
    if not any(_uses_the_session_app(item) for item in items):
        return
    request.getfixturevalue("session_app_deploy")
    secure = ROOT / "tests" / "e2e" / "secure"
    if any(secure in Path(item.path).resolve().parents for item in items):
        from tests.e2e.secure.conftest import APP

        request.getfixturevalue("app_pool").begin(APP)


@pytest.fixture(scope="session")
def session_app_deploy(app_pool, app_config):
    """The session app's deploy, begun (``AppPool.deploy``); ``app_url`` joins it. The app is built here, in the
    main thread."""
    from app.main import build_app

    return app_pool.deploy(build_app(app_config), "coserve", "/")


@pytest.fixture(scope="session")
def app_url(app_pool, app_config, session_app_deploy) -> str:
    """Base URL of the running app; waits until every node's replica is ready."""
    import httpx

    deadline = time.time() + 300
    session_app_deploy.wait(deadline)
    url = app_pool.base_url
    status = None
    while time.time() < deadline:
        try:
            status = httpx.get(f"{url}/v1/status", timeout=10).json()
            if status["ready_nodes"] == app_config["cluster"]["nodes"]:
                break
            if any(n["state"] == "failed" for n in status["nodes"]):
                pytest.fail(f"a replica failed to start: {status}")
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(0.25)
    else:
        pytest.fail(f"replicas not ready within 300 s: {status}")
    return url


@pytest.fixture(scope="session")
def planner(app_url):
    """The session app's planner actor (Serve runs it as the model server's deployment actor)."""
    from app.main import planner_of

    return planner_of("coserve")
