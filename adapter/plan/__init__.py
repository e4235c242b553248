"""`nd-adapter plan`: what a run will do, from the config and config.json alone (`build.py`), rendered as tables
(`render.py`), with models of per-GPU memory (`memory.py`) and per-group traffic (`traffic.py`). Imports no torch."""
