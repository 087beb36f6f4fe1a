"""Who takes part in each round: the types every policy shares (base), the policies, one small
object each (policies: all, sample, available, the fairness floor), Oort's utility (utility), the
selector agents that read the federation's history (agents), choosing outside the round keeper's
lock for an agent that asks a model (thinking), and the keeper's selector that records each choice
(keeper)."""
