import pytest
import torch

from rlk3.algo.effort import BudgetSchedule, effort_reward, over_budget
from rlk3.algo.mopd import TeacherRoutingError, mopd_token_rewards, route


def test_over_budget_is_exactly_minus_one():
    assert effort_reward(1.0, 101, 100) == -1.0
    assert effort_reward(0.0, 101, 100) == -1.0
    assert effort_reward(1.0, 100, 100) == 1.0
    assert effort_reward(0.5, 10**6, None) == 0.5
    assert over_budget(5, 4) and not over_budget(4, 4)


def test_budget_schedules_follow_their_formulas():
    lin = BudgetSchedule(start=512, end=128, steps=100, kind="linear")
    assert [lin.at(s) for s in (0, 25, 50, 100, 1000)] == [512, 416, 320, 128, 128]
    step = BudgetSchedule(start=512, end=128, steps=100, kind="step", milestones=4)
    assert [step.at(s) for s in (0, 24, 25, 49, 50, 99, 100)] == [512, 512, 416, 416, 320, 224, 128]
    assert BudgetSchedule(512, 128, 100, kind="constant").at(0) == 128
    # monotone non-increasing everywhere
    assert all(lin.at(s) >= lin.at(s + 1) for s in range(120))
    with pytest.raises(ValueError, match=r"0 < end <= start"):
        BudgetSchedule(start=100, end=200)
    with pytest.raises(ValueError, match=r"budget.kind must be one of"):
        BudgetSchedule(start=100, end=50, kind="cosine")


def test_mopd_reward_properties():
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(3, 7, generator=g) * 4
    t = -torch.rand(3, 7, generator=g) * 4
    mask = torch.ones(3, 7)
    mask[:, :2] = 0
    mask[1, 5:] = 0  # a tool-output span
    # teacher == student: zero everywhere
    assert torch.equal(mopd_token_rewards(s, s, mask), torch.zeros(3, 7))
    r = mopd_token_rewards(s, t, mask, clip=1.0)
    on = mask.bool()
    assert torch.equal(torch.sign(r[on]), torch.sign((t - s)[on]))  # sign follows log π_T − log π_S
    assert r.abs().max() <= 1.0 and (r[~on] == 0).all()  # clipped; masked tokens get 0
    # alpha > 0 with teacher == student reduces to the outcome reward on generated tokens
    outcome = torch.tensor([1.0, 0.0, -1.0])
    r2 = mopd_token_rewards(s, s, mask, outcome=outcome, alpha=0.5)
    assert torch.equal(r2, 0.5 * outcome[:, None] * mask)


def test_routing_uses_domain_and_effort():
    teachers = {(d, e): f"{d}-{e}" for d in ("general", "agentic") for e in ("low", "high")}
    assert route(teachers, "general", "high") == "general-high"
    assert route(teachers, "agentic", "low") == "agentic-low"
    with pytest.raises(TeacherRoutingError, match=r"no teacher for \(domain='general', effort='medium'\)"):
        route(teachers, "general", "medium")
    with pytest.raises(TeacherRoutingError):
        route(teachers, "coding", "high")
