"""Operating a run: systemd units, Flower, live status, the preflight doctor, and the run planner."""
