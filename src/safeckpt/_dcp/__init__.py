"""The glue to torch.distributed.checkpoint: safe metadata, readers and planners, save and load."""
