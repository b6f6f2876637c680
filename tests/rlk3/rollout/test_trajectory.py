"""Trajectory: invariants, and JSON / Arrow round trips bit for bit."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlk3.rollout.trajectory import Status, Trajectory, TrajectoryError, from_arrow, same, to_arrow


def example(seed: int = 0) -> Trajectory:
    rng = random.Random(seed)
    t = Trajectory(group_id="g1", task_id="agentic/42", domain="agentic", effort="medium", budget=512)
    t.messages = [
        {"role": "system", "content": "Reasoning effort: medium\nToken budget: 512"},
        {"role": "user", "content": "Find the port in config/ — ünïcödé ✓ \u0000 \ud7ff"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls config"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.ini\nb.ini\n"},
    ]
    t.append([rng.randrange(4096) for _ in range(30)], generated=False)
    for _ in range(3):
        n = rng.randrange(1, 20)
        t.append([rng.randrange(4096) for _ in range(n)], generated=True,
                 logprobs=[-rng.expovariate(1.0) for _ in range(n)], versions=[rng.randrange(5)] * n)
        t.append([rng.randrange(4096) for _ in range(rng.randrange(1, 9))], generated=False)
    t.token_rewards = [rng.uniform(-1, 1) for _ in range(t.num_generated)]
    t.token_rewards[0] = -0.0
    t.behaviour_logprobs[-1] = float("-inf")  # a token sampled at probability ~0 under top-p is representable
    t.reward, t.status, t.sandbox_id = 1.0, Status.FINISHED, "sbx-7"
    t.metrics = {"turns": 3, "tool_errors": 0, "grader": {"reasons": []}, "nan": float("nan"), "tiny": 5e-324}
    return t.validate()


def test_json_round_trip_is_exact():
    t = example()
    back = Trajectory.from_json(t.to_json())
    assert same(t, back)
    assert back.status is Status.FINISHED
    assert math.copysign(1.0, back.token_rewards[0]) == -1.0  # -0.0 survives


def test_arrow_round_trip_is_exact(tmp_path):
    import pyarrow.parquet as pq

    trajs = [example(i) for i in range(5)]
    trajs[2].token_rewards = None
    trajs[3].budget = None
    trajs[3].sandbox_id = None
    table = to_arrow(trajs)
    pq.write_table(table, tmp_path / "t.parquet")
    back = from_arrow(pq.read_table(tmp_path / "t.parquet"))
    assert len(back) == 5 and all(same(a, b) for a, b in zip(trajs, back))


def test_same_detects_a_one_ulp_change():
    a, b = example(), example()
    b.behaviour_logprobs[0] = math.nextafter(b.behaviour_logprobs[0], 0.0)
    assert not same(a, b)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.lists(st.integers(0, 2**31 - 1), max_size=8), st.booleans(),
                       st.floats(allow_nan=True, allow_infinity=True)), max_size=12),
    st.text(max_size=200),
    st.dictionaries(st.text(max_size=10), st.one_of(st.integers(), st.floats(), st.text(max_size=20)), max_size=5),
)
def test_round_trips_for_arbitrary_content(chunks, text, metrics):
    t = Trajectory(messages=[{"role": "assistant", "content": text}], metrics=metrics)
    for ids, generated, lp in chunks:
        t.append(ids, generated, logprobs=[lp] * len(ids) if generated else None,
                 versions=[1] * len(ids) if generated else None)
    t.validate()
    assert same(t, Trajectory.from_json(t.to_json()))
    assert same(t, from_arrow(to_arrow([t]))[0])


def test_invariants_name_the_field():
    t = example()
    t.behaviour_logprobs.pop()
    with pytest.raises(TrajectoryError, match=r"behaviour_logprobs must have one entry per generated token"):
        t.validate()
    with pytest.raises(TrajectoryError, match=r"domain must be one of \['general', 'agentic', 'coding'\]"):
        Trajectory(domain="math").validate()
    with pytest.raises(TrajectoryError, match=r"status must be one of"):
        Trajectory(status="done")
    with pytest.raises(TrajectoryError, match=r"unknown Trajectory fields \['rewardz'\]"):
        Trajectory.from_dict({**example().to_dict(), "rewardz": 1})
    with pytest.raises(TrajectoryError, match="one logprob and one policy version each"):
        Trajectory().append([1, 2], generated=True, logprobs=[0.0], versions=[0, 0])


def test_dense_scatters_onto_the_stream():
    t = Trajectory()
    t.append([1, 2], generated=False)
    t.append([3, 4], generated=True, logprobs=[-0.5, -0.25], versions=[7, 8])
    t.append([5], generated=False)
    assert t.dense(t.behaviour_logprobs) == [0.0, 0.0, -0.5, -0.25, 0.0]
    assert t.dense(t.policy_versions, fill=-1) == [-1, -1, 7, 8, -1]
