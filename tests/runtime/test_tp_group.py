"""`TpGroup` without a process group: what a layer binds at load (`all_reduce_or_none`) and the shards."""

from __future__ import annotations

from kvq.runtime.distributed.group import TpGroup


def test_one_rank_binds_no_all_reduce() -> None:
    assert TpGroup.single().all_reduce_or_none is None  # a --tp 1 step never calls into the group
    two = TpGroup(rank=1, size=2)
    bound = two.all_reduce_or_none
    assert bound is not None and bound.__self__ is two and bound.__func__ is TpGroup.all_reduce
    assert two.shard(8, "heads") == (4, 8)
