"""`nd-adapter plan`: what a run will do, from the config and config.json alone (`build.py`), rendered as tables
(`render.py`), with models of per-GPU memory (`memory.py`), per-group traffic (`traffic.py`) and step time
(`timing.py`, on a hardware profile from `hardware.py`), and `--search` over layouts (`search.py`). Imports no
torch; `calibrate.py` (the GPU micro-benchmarks behind a profile) imports it inside."""
