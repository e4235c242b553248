"""The CPU main job (`make demo`): build a tiny model and data (`build.py`), then plan, convert, train, resume,
export and generate through the real CLI (`run.py`; `python -m adapter.demo`)."""
