"""Post-training that needs training and generation at once (GRPO's rollouts from the policy
being trained): the room above `train/` and `infer/`, which never import each other, composing
the trainer and the engine through their public APIs (ARCHITECTURE.md, "Layers"). The user's
reward functions are loaded and called here (rewards.py)."""
