"""client.chain.failover_plan: who is at fault for a failed pushed step, decided from the error alone."""

from __future__ import annotations

import pytest
import torch

from corolla.client.chain.failover_plan import Culprit, Repair, culprit, repair_plan
from corolla.client.chain.push_audit import BadAnswer, Blame
from corolla.client.chain.span_session import LinkFailed, PushFailed
from corolla.protocol.errors import ErrorCode, PeerUnavailable, RemoteError

PUSH_FAILED = PushFailed("push to next failed", torch.zeros(1, 1, 4))
LYING_PUSHER = BadAnswer("B", Blame("pusher", "the receipt shows another tensor"))
BAD_ANSWER = BadAnswer("B", Blame("receiver", "NaN in the output"))
SILENT = PeerUnavailable("server B did not answer within 5.0s")
REFUSED = LinkFailed("server B refused the step A pushed (digest: ...)", "A", "B")
ERROR = RemoteError(ErrorCode.INTERNAL, "boom", peer="B")


@pytest.mark.parametrize("index, error, plan, fault", [
    (1, PUSH_FAILED, Repair("relay_on", 2), None),  # it answered: the link after it failed, nobody's fault
    (2, LYING_PUSHER, Repair("convict_pusher", 1), Culprit(1, distrust=True)),  # its own signature convicts it
    (2, BAD_ANSWER, Repair("replace", 2), Culprit(2, distrust=False)),  # a BadAnswer is a PeerUnavailable too
    (2, SILENT, Repair("relay_unpushed", 2), None),  # the push may never have come: the relay finds out
    (2, REFUSED, Repair("relay_unpushed", 2), None),  # one's word against the other's: the link is cut
    (0, SILENT, Repair("replace", 0), Culprit(0, distrust=False)),  # the client sent it the step itself
    (1, ERROR, Repair("replace", 1), Culprit(1, distrust=False)),
])
def test_the_plan_follows_the_table_in_the_module_doc(index, error, plan, fault):
    assert repair_plan(index, error) == plan
    assert culprit(index, error) == fault


def test_anything_else_is_not_a_step_failure():
    with pytest.raises(TypeError):
        repair_plan(0, ValueError("a bug, not a server"))
