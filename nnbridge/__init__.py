"""nnbridge: every intermediate operation of a PyTorch model as a named, patchable point."""
