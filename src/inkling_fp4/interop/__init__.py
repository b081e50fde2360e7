"""Nemotron-H checkpoints in and out of fp4train, and NVFP4 checkpoints that serving engines load.

:mod:`~.export` is ``fp4train export``; :mod:`~.load_run` reads a run, checkpoint or Nemotron-H directory.
"""
