"""The LoRA driver's bookkeeping between publishes, and which errors are an adapter's own fault."""

from __future__ import annotations

import pytest

from actors.learning.lora.rank import GroupFailed
from actors.learning.lora.rank_group import RankFault, transient
from actors.learning.lora.unpublished import UnpublishedVersion
from actors.learning.store.models import StoreError
from actors.learning.store.records import FeedbackItem


def _item(i: int) -> FeedbackItem:
    return FeedbackItem(i, "a", "sft", f"p{i}", " c.", None, None, created_at=100.0 + i)


def test_an_item_is_held_only_once_an_optimizer_step_applies_it_and_a_requeued_one_never():
    v = UnpublishedVersion()
    assert not v.started and v.taken() == []
    v.add_micro_step([_item(1), _item(2)], loss=2.0)
    v.add_micro_step([_item(3)], loss=5.0)
    assert v.started and v.taken() == [1, 2, 3] and v.held == []  # accumulated, not applied: not publishable
    v.applied(requeued={2})  # CheckEnd sent item 2 back to the queue for another pass
    assert (v.micro_done, v.opt_steps, v.held, v.held_created) == (0, 1, [1, 3], [101.0, 103.0])
    assert v.taken() == [1, 3]
    assert v.mean_loss() == pytest.approx((2.0 * 2 + 5.0 * 1) / 3)  # weighted by items
    v.add_micro_step([_item(4)], loss=1.0)
    v.drop_micro_steps()  # zeroed gradients: item 4 stays queued in the store
    assert v.taken() == [1, 3] and v.micro_done == 0 and v.started  # the applied step is still to publish
    assert UnpublishedVersion().mean_loss() == 0.0


def test_only_an_adapters_own_error_pauses_it():
    """A rank's own exception reaches the driver as a RankFault (``RankGroup.gather``, exercised live by
    tests/integration/test_adapter_faults.py); a task error of the store or the planner is theirs unless the store
    refused the adapter's request."""
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    def raised_in(actor_method: str, cause: BaseException) -> BaseException:
        return RayTaskError(actor_method, "traceback", cause).as_instanceof_cause()

    # The adapter's fault: it pauses that adapter.
    assert not transient(RankFault("no module named no_such_module"))
    assert not transient(raised_in("FeedbackStore.publish_version", StoreError("version 3 was already published")))
    assert not transient(ValueError("an error of the driver's own, for this adapter"))
    # The group's or the cluster's: the ranks start again and every adapter goes on.
    assert transient(raised_in("TrainRank.run_windows", GroupFailed("gloo: connection closed by peer")))
    assert transient(GroupFailed("another rank died"))
    assert transient(raised_in("FeedbackStore.take_batch", OSError("disk I/O error")))
    assert transient(RayActorError())
    assert transient(GetTimeoutError())
    assert transient(ConnectionError())
