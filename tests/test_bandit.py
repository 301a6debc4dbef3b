"""The GRPO core on a contextual bandit, no diffusion involved: a controller picks one of four
configurations under a latency budget; groups are (sample_id, budget) pairs."""
import numpy as np
import torch

from ddpo_grpo.core.loss import KLInputs, grpo_loss
from ddpo_grpo.core.reference import EMAReference
from ddpo_grpo.core.stat_tracking import PerPromptStatTracker
from ddpo_grpo.trainer.checks.verification import verify_groups

LATENCY = torch.tensor([1.0, 2.0, 3.0, 4.0])
ACCURACY = torch.tensor([0.3, 0.5, 0.7, 0.9])
BUDGETS = [1.0, 2.0, 3.0, 4.0]
OPTIMAL = [0, 1, 2, 3]  # the most accurate configuration that fits the budget
SAMPLE_OFFSET = [0.0, 1.0, -0.5]  # per-sample difficulty: removed by the group baseline


def reward(sample_id: torch.Tensor, budget: torch.Tensor, arm: torch.Tensor) -> torch.Tensor:
    over = torch.clamp(LATENCY[arm] - budget, min=0.0)
    return ACCURACY[arm] - 0.5 * over + torch.tensor(SAMPLE_OFFSET)[sample_id]


def test_reward_has_unique_optimum_per_budget():
    for b, best in zip(BUDGETS, OPTIMAL):
        r = reward(torch.zeros(4, dtype=torch.long), torch.full((4,), b), torch.arange(4))
        assert int(r.argmax()) == best and (r.topk(2).values[0] - r.topk(2).values[1]) > 0.1


def test_grpo_learns_the_optimal_arm_per_budget():
    torch.manual_seed(0)
    policy = torch.nn.Linear(len(BUDGETS), 4)
    torch.nn.init.zeros_(policy.weight)  # start uniform over arms
    torch.nn.init.zeros_(policy.bias)
    opt = torch.optim.Adam(policy.parameters(), lr=0.05)
    ref = EMAReference(policy, alpha=0.9, update_freq=2)
    tracker = PerPromptStatTracker(std_mode="group")
    k = 8

    pairs = [(s, b) for s in range(len(SAMPLE_OFFSET)) for b in range(len(BUDGETS))]
    sample_id = torch.tensor([s for s, _ in pairs for _ in range(k)])
    budget_idx = torch.tensor([b for _, b in pairs for _ in range(k)])
    budget = torch.tensor(BUDGETS)[budget_idx]
    x = torch.nn.functional.one_hot(budget_idx, len(BUDGETS)).float()
    keys = [(int(s), float(b)) for s, b in zip(sample_id, budget)]

    for epoch in range(25):
        with torch.no_grad():
            dist = torch.distributions.Categorical(logits=policy(x))
            arm = dist.sample()
            old_lp = dist.log_prob(arm)
        tracker.clear()
        adv = torch.from_numpy(tracker.update(keys, reward(sample_id, budget, arm)))
        verify_groups(np.array([s * len(BUDGETS) + b for s, b in pairs for _ in range(k)]), adv.numpy(),
                      np.ones(len(keys), bool), reward(sample_id, budget, arm).numpy(), k, tracker)
        assert tracker.get_stats()["trained_prompt_num"] == len(pairs)
        for _ in range(2):
            with ref.swapped(policy):  # the reference forward comes before the policy forward
                ref_lp = torch.distributions.Categorical(logits=policy(x)).log_prob(arm)
            lp = torch.distributions.Categorical(logits=policy(x)).log_prob(arm)
            loss, metrics = grpo_loss(lp, old_lp, adv, clip_range=0.2, ref=KLInputs(ref_log_prob=ref_lp),
                                      beta=0.01, kl_type="k3")
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref.step()
        if epoch == 0:
            assert metrics["kl"].item() > 0.0  # the reference lags the policy

    with torch.no_grad():
        greedy = policy(torch.eye(len(BUDGETS))).argmax(dim=1)
    assert greedy.tolist() == OPTIMAL
    assert ref.num_updates == 25
