"""Celery wiring: the app, its two lanes' tasks, and worker start-up."""
