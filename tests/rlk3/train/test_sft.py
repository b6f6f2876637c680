"""The SFT stage's batch sampler (the stage end to end is test_sft_acceptance.py, slow)."""

import itertools
import random

from rlk3.train.sft import BucketedBatches


def test_bucketed_batches_cover_every_row_once_and_pad_little():
    rng = random.Random(0)
    lengths = [rng.choice([95, 120, 250, 300]) + rng.randint(-10, 10) for _ in range(1000)]
    sampler = BucketedBatches(lengths, 16, seed=0)
    first, second = list(sampler), list(sampler)  # two epochs
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second  # reshuffled each epoch

    batches = [first[i : i + 16] for i in range(0, len(first), 16)]  # how the data loader cuts the stream
    assert all(len(b) == 16 for b in batches[:-1]) and len(batches[-1]) == 1000 % 16
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert sum(lengths) / padded > 0.85  # random batches of this mix: ~0.65
    # short and long rows alternate step by step, not in long runs
    long = [max(lengths[i] for i in b) > 200 for b in batches]
    assert max(len(list(run)) for _, run in itertools.groupby(long)) < 12
