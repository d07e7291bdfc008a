"""The HTTP routes, one module per front or concern."""
