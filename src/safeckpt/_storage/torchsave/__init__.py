"""The torch.save zip archive that holds one tensor, written and read without torch.save's pickler."""
