"""`python -m dfq_testing.faulty_worker worker LANE -c CONFIG ...`: the `dflash-queue` command with the faults of
`DFQ_INJECT_FAULTS` installed first (dflash_queue/faults.py), the only way a worker takes them: a worker started
the ordinary way refuses to start with that variable set."""

from __future__ import annotations

from dflash_queue import faults


def main() -> None:
    from dflash_queue.cli import main as cli

    faults.install_from_environment()
    cli()


if __name__ == "__main__":
    main()
