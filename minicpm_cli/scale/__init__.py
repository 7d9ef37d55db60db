"""Scale-out: `minicpm bulk` (items read and named, seeds, the manifest, resuming; batches in this
process or on Ray Data actors), joining a Ray cluster, and the server as a Ray Serve deployment.

Ray is imported only here and only when asked for (`--ray`). May import the engine, voices, serving
and the shared leaves; never the command line.
"""
