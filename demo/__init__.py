"""The main job: ``pbsd demo`` wires the world, the warm policy and the four services together,
trains, evaluates and reports. Nothing else imports it."""
