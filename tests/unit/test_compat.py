"""compat/ was read against the installed libraries: their versions are the ones it names, and each private
name it relies on is still there. A failure here means: read the new release's source for each name in
compat/__init__.py, then update CHECKED_VERSIONS."""

from __future__ import annotations

import importlib
import inspect

import pytest

import compat


def test_installed_versions_are_the_checked_ones():
    installed = compat.installed_versions()
    assert installed == compat.CHECKED_VERSIONS, (
        f"compat/ was checked against {compat.CHECKED_VERSIONS}; installed: {installed}"
    )


@pytest.mark.parametrize("module,name", compat.PRIVATE_NAMES, ids=lambda v: v)
def test_each_private_name_exists(module, name):
    obj = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(obj, part), f"{module}.{name}: no {part!r} in this release"
        obj = getattr(obj, part)


@pytest.mark.parametrize("module,cls,attribute", compat.PRIVATE_INSTANCE_ATTRIBUTES, ids=lambda v: v)
def test_each_private_instance_attribute_is_still_set(module, cls, attribute):
    source = inspect.getsource(getattr(importlib.import_module(module), cls))
    assert f"self.{attribute} =" in source or f"    {attribute}:" in source, (
        f"{module}.{cls} no longer sets {attribute!r}"
    )


def test_the_haproxy_manager_class_is_ray_s():
    manager = compat.ray_haproxy_manager_class()
    assert inspect.isclass(manager) and manager.__name__ == "HAProxyManager"


def test_task_id_of_reads_the_request_id_vllm_builds():
    # vLLM builds these in its serving classes from the X-Request-Id header (``_base_request_id``).
    from vllm.entrypoints.openai.chat_completion import serving as chat
    from vllm.entrypoints.openai.completion import serving as completion

    from actors.serving.request_traces import task_id_of

    assert 'f"cmpl-{self._base_request_id(raw_request, request.request_id)}"' in inspect.getsource(completion)
    assert 'f"{request_id}-{i}"' in inspect.getsource(completion)
    assert 'f"chatcmpl-{self._base_request_id(raw_request, request.request_id)}"' in inspect.getsource(chat)
    assert task_id_of("cmpl-trace-me-1-0") == "trace-me-1"
    assert task_id_of("cmpl-abc-3") == "abc"
    assert task_id_of("chatcmpl-trace-me-2") == "trace-me-2"
    assert task_id_of("warmup-lora") == "warmup-lora"
