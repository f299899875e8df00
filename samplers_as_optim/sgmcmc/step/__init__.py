"""The step pipeline's stages: the plan, guard, ready, the two backends, and what they use."""
