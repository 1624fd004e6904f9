"""Loading a checkpoint into a model and generating text with it."""
