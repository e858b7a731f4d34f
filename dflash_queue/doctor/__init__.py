"""`dflash-queue doctor`: preflight checks of a node against its config, one verdict per line (`preflight.py`
runs them all; each other module checks one thing).

The package imports nothing itself: the broker's checks (`broker.py`), which every command that talks to the
broker runs first, stay as light as a command that needs no model.
"""
