"""A replica's engine core waits for its worker's step in short sleeps, not spinning; other vLLM processes are left alone."""

from __future__ import annotations

import time

import pytest

shm = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast", reason="vLLM is not installed")


def test_a_reader_sleeps_between_looks_and_only_a_replicas_engine_core_is_changed(monkeypatch, tmp_path):
    import zmq

    import compat
    from actors.serving import engine_process

    monkeypatch.setattr(shm, "SpinCondition", shm.SpinCondition)  # restored after the test
    original = shm.SpinCondition
    monkeypatch.setenv(engine_process.QUIET_VAR, "1")
    engine_process.configure()  # this is no engine-core process: nothing changes
    assert shm.SpinCondition is original
    assert compat.engine_core_waits_without_spinning(0.002) and compat.engine_core_waits_without_spinning(0.002)
    assert issubclass(shm.SpinCondition, original) and shm.SpinCondition is not original

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/notify"
    writer = shm.SpinCondition(is_reader=False, context=ctx, notify_address=address)
    reader = shm.SpinCondition(is_reader=True, context=ctx, notify_address=address)
    try:
        reader.record_read()  # just read: vLLM's reader would now call sched_yield in a loop for a second
        cpu0, t0 = time.thread_time(), time.perf_counter()  # this thread: a spin burns the waiter's own CPU
        for _ in range(50):
            reader.wait(timeout_ms=10)
        waited, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        assert waited >= 50 * 0.002 and cpu < 0.5 * waited, (waited, cpu)
        writer.notify()  # past the busy second, vLLM's own idle wait is untouched: woken by the writer
        reader.last_read -= 2.0
        time.sleep(0.1)
        t0 = time.perf_counter()
        reader.wait(timeout_ms=5000)
        assert time.perf_counter() - t0 < 1.0
    finally:
        for sock in (
            reader.local_notify_socket,
            reader.read_cancel_socket,
            reader.write_cancel_socket,
            writer.local_notify_socket,
        ):
            sock.close(linger=0)
        ctx.term()
