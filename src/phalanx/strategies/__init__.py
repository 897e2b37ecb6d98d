"""One module per strategy."""
