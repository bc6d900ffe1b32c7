"""Policy-gradient pieces: group advantages, the clipped surrogate loss, AQN noise."""
