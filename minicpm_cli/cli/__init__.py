"""The command line: `minicpm` and its commands (parse and check options, then call one function of
the subsystem that does the work), the entry point (Ctrl-C from the first instruction), `bench`,
and start-up timing.

The top of the house: may import every other part; nothing imports it. Importing this package is
cheap (`minicpm --help` loads no torch).
"""
