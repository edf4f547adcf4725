"""CheckpointManager and the collaborators it is built from."""
