"""Batch order: per-process shards fixed across epochs (what the feature memo relies on), lockstep counts."""

from selfspec.train.batching import epoch_batches


def flat(batches):
    return [i for b in batches for i in b]


def test_each_process_keeps_its_shard_every_epoch_and_shards_are_disjoint():
    n, bs, world = 103, 4, 2
    shards = []
    for rank in range(world):
        per_epoch = [epoch_batches(n, bs, e, seed=7, rank=rank, world=world) for e in range(3)]
        assert len({len(b) for b in per_epoch}) == 1 and len(per_epoch[0]) == (n // world) // bs
        seen = set().union(*(flat(b) for b in per_epoch))
        assert len(seen) <= n // world  # the same shard every epoch (less a partial last batch)...
        assert flat(per_epoch[0]) != flat(per_epoch[1])  # ...in a new order
        shards.append(seen)
    assert not shards[0] & shards[1]
    assert len(epoch_batches(n, bs, 0, 7, 0, 2)) == len(epoch_batches(n, bs, 0, 7, 1, 2))


def test_one_process_sees_every_whole_batch_and_order_is_reproducible():
    batches = epoch_batches(10, 3, epoch=1, seed=0)
    assert [len(b) for b in batches] == [3, 3, 3] and len(set(flat(batches))) == 9
    assert batches == epoch_batches(10, 3, epoch=1, seed=0)
    assert batches != epoch_batches(10, 3, epoch=1, seed=1)
