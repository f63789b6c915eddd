"""Checkpoints: the HF tensor layout of a spec (`layout`), NVFP4 in ModelOpt's format (`nvfp4`), random
checkpoints (`init.init_weights`) and per-rank loading keyed by graph param name (`loader.load_rank_weights`).

Import the submodules directly; this package imports nothing so that `beamc.checkpoint.layout` stays light.
"""
