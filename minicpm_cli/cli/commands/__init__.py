"""The commands of `minicpm`, a module each (`say` and `reply` share one): each parses and checks its
options, then calls one function of the subsystem that does the work. `cli.app` registers them.
"""
