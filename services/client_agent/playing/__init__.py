"""Playing and scoring episodes: the env server's client (envclient), the tasks an environment
offers (tasks), prompts (prompts), the action policy (policy, generation, actions), episodes run
side by side (rollout) and a round's phases of play (episodes)."""
