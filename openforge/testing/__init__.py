"""Test fixtures shared across areas (stdlib only, so they also load in the light Python 3.12 env)."""
