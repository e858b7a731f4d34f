from dflash_queue.cli import main

main()
