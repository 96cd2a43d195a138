"""Trainer: run controller, REST API for runs, policy update, weight publishing and checkpoints."""
