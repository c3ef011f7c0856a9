"""Rollouts: tasks x toolchains x attempts, each verified and its reward reported through the proxy."""
