"""The GRPO objective: the loss and its masks, importance weights, and the adaptive entropy controller."""
