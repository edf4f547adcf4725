"""The state walk: tensors to DCP wherever they sit, every other value to the pickle-free train-state file."""
