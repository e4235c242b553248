"""Training: the engine's set-up (`engine.py`), the loop (`trainer.py`), checkpoints, metrics, profiling, HF export;
the per-process entry (`worker.py`), the local launcher (`spawn.py`), pre-flight checks and rehearsals."""
