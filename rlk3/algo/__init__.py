"""RL math: advantages, the policy loss with per-token off-policy correction, effort budgets, MOPD rewards."""
