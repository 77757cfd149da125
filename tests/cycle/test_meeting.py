"""The node's meeting at BARRIER: everyone or a deadline naming who did not come."""

from __future__ import annotations

import anyio
import pytest

from timeshare.cycle.meeting import NodeMeeting
from timeshare.errors import CollectiveTimeout


@pytest.mark.asyncio
async def test_no_rank_passes_until_every_rank_came_generation_after_generation() -> None:
    meeting = NodeMeeting(3, first_rank=6)
    for generation in (1, 2):
        passed: list[int] = []

        async def meet(rank: int, passed: list[int] = passed) -> None:
            await meeting.meet(rank, timeout_s=10.0)
            passed.append(rank)

        async with anyio.create_task_group() as group:
            group.start_soon(meet, 0)
            group.start_soon(meet, 2)
            await anyio.sleep(0.05)
            assert passed == [], generation  # rank 1 has not come
            group.start_soon(meet, 1)
        assert sorted(passed) == [0, 1, 2]
    assert meeting.generation == 3


@pytest.mark.asyncio
async def test_a_timeout_names_the_ranks_that_did_not_come_by_global_number() -> None:
    meeting = NodeMeeting(4, first_rank=4, node=1)
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: meeting.meet(3, timeout_s=5.0))
        await anyio.sleep(0.01)  # rank 3 came
        with pytest.raises(CollectiveTimeout) as info:
            await meeting.meet(1, timeout_s=0.1)
        group.cancel_scope.cancel()
    failure = info.value
    assert isinstance(failure, CollectiveTimeout)
    assert failure.missing == [4, 6] and failure.generation == 1
    assert "on rank 5: ranks [4, 6] did not arrive (node 1)" in str(failure)


@pytest.mark.asyncio
async def test_a_called_off_meeting_starts_afresh() -> None:
    meeting = NodeMeeting(2)
    with anyio.move_on_after(0.05):
        await meeting.meet(0, timeout_s=10.0)  # cancelled, as a drain cancels it
    meeting.call_off()
    with pytest.raises(CollectiveTimeout, match=r"ranks \[0\] did not arrive"):
        await meeting.meet(1, timeout_s=0.05)  # rank 0's arrival was of the old meeting
    with pytest.raises(ValueError, match=r"rank 2 is not in 0\.\.1"):
        await meeting.meet(2, timeout_s=1.0)
